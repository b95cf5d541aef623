"""How a Keras internal is found and checked: the finders, `Internal`, `require` and the one
error, `KerasInternalsError`, naming the internal and the Keras version.

Reaches into no Keras area itself: each area's module (`trainers`, `compile_utils`, `layers`,
`optimizers`, `losses`, `callbacks`, `data_adapters`, `global_state`, `serialization`) lists
its internals with these.

Each internal is found by *what it is*, not by a module path Keras may reorganise: an
attribute of a public class (`keras.Model._symbolic_build`; `keras.Model`'s MRO holds the
trainer classes, whatever Keras calls them: Keras 3.16 renamed `Trainer` to `BaseTrainer`
and `TensorFlowTrainer` to `Trainer`), the backend's own class in a public class's MRO (the
TensorFlow optimizer base is the class of `keras.optimizers.Optimizer.__mro__` that defines
`_all_reduce_sum_gradients`), or the module a public function is defined in
(`keras.utils.set_random_seed.__module__` holds `GLOBAL_RANDOM_SEED`). A module path is only
the last resort, where no public object leads to the name.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import keras

from keras_accel.utils.library_internals import InternalsError

# The Keras minor versions the suite passed on (pyproject.toml's range admits these only; 3.16
# as keras-nightly 3.16.0.dev2026102704).
TESTED_KERAS = "3.15 and 3.16"


def public(path: str) -> Callable[[], Any]:
    """The public object at `path` ("keras.Model", "keras.callbacks.ModelCheckpoint")."""

    def find():
        parts = path.split(".")
        assert parts[0] == "keras", path
        target = keras
        for part in parts[1:]:
            target = getattr(target, part)
        return target

    return find


def module_of(path: str) -> Callable[[], Any]:
    """The module the public function or class at `path` is defined in."""

    def find():
        return sys.modules[inspect.unwrap(public(path)()).__module__]

    return find


def globals_of(path: str, name: str) -> Callable[[], Any]:
    """`name` as the public function at `path` sees it: its module's global of that name
    (`keras.Model.compile` creates its `CompileMetrics`)."""

    def find():
        return inspect.unwrap(public(path)()).__globals__[name]

    return find


def class_in_mro(path: str, defining: str) -> Callable[[], type]:
    """The first class in the MRO of the public class at `path` that itself defines
    `defining`: the backend's trainer is the one of `keras.Model.__mro__` defining
    `make_train_function`, the TF optimizer base the one of `keras.optimizers.Optimizer`'s
    defining `_all_reduce_sum_gradients`."""

    def find():
        for cls in public(path)().__mro__:
            if defining in vars(cls):
                return cls
        raise LookupError(f"no class in {path}.__mro__ defines {defining}")

    return find


def module_of_class(find_class: Callable[[], type]) -> Callable[[], Any]:
    """The module a class found by `find_class` is defined in."""
    return lambda: sys.modules[find_class().__module__]


def module_at(path: str) -> Callable[[], Any]:
    """The module at `path`: the last resort, where no public object leads to it."""
    return lambda: importlib.import_module(path)


def first(*finders: Callable[[], Any]) -> Callable[[], Any]:
    """What the first finder that succeeds finds."""

    def find():
        error: Exception | None = None
        for finder in finders:
            try:
                return finder()
            except NOT_FOUND as caught:
                error = caught
        raise LookupError("not found") from error

    return find


# What a finder raises where Keras no longer has what it looks for.
NOT_FOUND = (ImportError, AttributeError, KeyError, LookupError)


@dataclasses.dataclass(frozen=True)
class Internal:
    """`name`, an attribute of what `find()` returns (`where` says what that is)."""

    where: str
    name: str
    why: str
    find: Callable[[], Any]


class KerasInternalsError(InternalsError):
    """A Keras internal that keras_accel relies on is missing from the installed Keras."""


def missing(where: str, name: str, why: str) -> KerasInternalsError:
    """The error for the internal `name` of `where`, naming the installed Keras version."""
    return KerasInternalsError(
        f"keras_accel relies on the Keras internal `{name}` of {where} ({why}), which Keras "
        f"{keras.__version__} does not have. keras_accel is tested with Keras "
        f"{TESTED_KERAS}: install the pinned versions with `pip install -c constraints.txt -e"
        f' ".[all]"`, or report this Keras version to keras_accel.'
    )


def holder(internal: Internal):
    """What holds `internal`, or a `KerasInternalsError` naming it and the Keras version:
    found as `check()` finds it, so that what is used is what was checked."""
    try:
        target = internal.find()
    except NOT_FOUND:
        raise missing(internal.where, internal.name, internal.why) from None
    if not hasattr(target, internal.name):
        raise missing(internal.where, internal.name, internal.why)
    return target


def require(obj, name: str, why: str):
    """`getattr(obj, name)`, or a `KerasInternalsError` naming the Keras version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing(type(obj).__qualname__, name, why) from None
