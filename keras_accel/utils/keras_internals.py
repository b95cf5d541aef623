"""Every Keras internal keras_accel touches, listed in one place and checked once.

keras_accel uses Keras's public API wherever Keras has one. Where it has no public extension
point, the private names below are what keras_accel relies on; `check()` verifies all of them
against the installed Keras (`Accelerator.prepare` calls it), so that a Keras release that
renames one fails loudly, naming the Keras version and the name, instead of quietly doing
nothing. Code elsewhere reads these names through this module only.
"""

from __future__ import annotations

import functools
import importlib

import keras

TESTED_KERAS = "3.15"

# (where, name, why): module-level names and class attributes keras_accel reads or replaces.
# Instance attributes that Keras sets in __init__ are checked on the instance (`require`).
REQUIRED: list[tuple[str, str, str]] = [
    ("keras.src.backend.config", "keras_home", "where keras.json lives (`keras-accel env`)"),
]


class KerasInternalsError(RuntimeError):
    """A Keras internal that keras_accel relies on is missing from the installed Keras."""


def _error(where: str, name: str, why: str) -> KerasInternalsError:
    return KerasInternalsError(
        f"keras_accel relies on the Keras internal `{where}.{name}` ({why}), which Keras "
        f"{keras.__version__} does not have. keras_accel is tested with Keras {TESTED_KERAS}: "
        f'install it with `pip install -c constraints.txt -e ".[all]"` (or '
        f'"keras=={TESTED_KERAS}.*"), or report this Keras version to keras_accel.'
    )


def _resolve(where: str):
    module, _, attribute = where.partition(":")
    target = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        target = getattr(target, part)
    return target


@functools.cache
def check() -> None:
    """Verify every internal in `REQUIRED` once per process; raise `KerasInternalsError`."""
    for where, name, why in REQUIRED:
        try:
            target = _resolve(where)
        except (ImportError, AttributeError):
            raise _error(where, name, why) from None
        if not hasattr(target, name):
            raise _error(where, name, why)


def require(obj, name: str, why: str):
    """`getattr(obj, name)`, or a `KerasInternalsError` naming the Keras version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error(type(obj).__qualname__, name, why) from None


def keras_home() -> str:
    """The Keras home directory that Keras chose at import (KERAS_HOME, ~/.keras or
    /tmp/.keras when the home directory is read-only)."""
    from keras.src.backend import config

    return config.keras_home()
