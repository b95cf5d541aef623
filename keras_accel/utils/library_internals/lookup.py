"""How a private name of another library is found and checked: `Internal`, the errors, and
`find`/`find_optional`, naming the library and its installed version.

Reaches into no library itself: each library's module (`stdlib`, `pytorch`, `tensorflow_ops`,
`jax_runtime`, `grain_datasets`) lists its internals with these."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any


class InternalsError(RuntimeError):
    """An internal that keras_accel relies on is missing from an installed library."""


class LibraryInternalsError(InternalsError):
    """A private name of Python, torch, TensorFlow, JAX or Grain that keras_accel relies on
    is missing from the installed version."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """`module.name` of `library`, needed for `why`; `fallback` is what happens without it
    (None: `LibraryInternalsError`)."""

    library: str
    module: str
    name: str
    why: str
    fallback: str | None = None


def version(library: str) -> str:
    """The installed version of `library` ("Python", "torch", "TensorFlow", "JAX", "Grain")."""
    if library == "Python":
        return sys.version.split()[0]
    module = {"TensorFlow": "tensorflow", "JAX": "jax", "Grain": "grain"}.get(library, library)
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return "(version unknown)"


def missing(internal: Internal) -> LibraryInternalsError:
    """The error for `internal`, naming its library and that library's installed version."""
    return LibraryInternalsError(
        f"keras_accel relies on the {internal.library} internal `{internal.name}` of "
        f"{internal.module} ({internal.why}), which {internal.library} "
        f"{version(internal.library)} does not have. Install the pinned versions with "
        '`pip install -c constraints.txt -e ".[all]"`, or report this version to keras_accel.'
    )


def find(internal: Internal) -> Any:
    """`module.name` (or `module:Class.name`) of `internal`, or `LibraryInternalsError`."""
    module_name, _, class_name = internal.module.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        raise missing(internal) from None
    if class_name:
        owner = getattr(owner, class_name, None)
    if owner is None or not hasattr(owner, internal.name):
        raise missing(internal)
    return getattr(owner, internal.name)


def find_optional(internal: Internal) -> Any | None:
    """`module.name` of the optional `internal`, or None."""
    try:
        return find(internal)
    except LibraryInternalsError:
        return None
