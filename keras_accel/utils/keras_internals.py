"""Every Keras internal keras_accel touches, listed in one place and checked once.

keras_accel uses Keras's public API wherever Keras has one. Where it has no public extension
point, the private names below are what keras_accel relies on; `check()` verifies all of them
against the installed Keras (`Accelerator.prepare` calls it, and keras_accel's callbacks may:
it runs once per process), so that a Keras release that renames one fails loudly, naming the
Keras version and the name, instead of quietly doing nothing. Code elsewhere reads these
names through this module only.

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
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import keras

# The Keras minor versions the suite passed on (pyproject.toml's range admits these only; 3.16
# as keras-nightly 3.16.0.dev2026102704).
TESTED_KERAS = "3.15 and 3.16"


def _public(path: str) -> Callable[[], Any]:
    """The public object at `path` ("keras.Model", "keras.callbacks.ModelCheckpoint")."""

    def find():
        parts = path.split(".")
        assert parts[0] == "keras", path
        target = keras
        for part in parts[1:]:
            target = getattr(target, part)
        return target

    return find


def _module_of(path: str) -> Callable[[], Any]:
    """The module the public function or class at `path` is defined in."""

    def find():
        return sys.modules[inspect.unwrap(_public(path)()).__module__]

    return find


def _globals_of(path: str, name: str) -> Callable[[], Any]:
    """`name` as the public function at `path` sees it: its module's global of that name
    (`keras.Model.compile` creates its `CompileMetrics`)."""

    def find():
        return inspect.unwrap(_public(path)()).__globals__[name]

    return find


def _class_in_mro(path: str, defining: str) -> Callable[[], type]:
    """The first class in the MRO of the public class at `path` that itself defines
    `defining`: the backend's trainer is the one of `keras.Model.__mro__` defining
    `make_train_function`, the TF optimizer base the one of `keras.optimizers.Optimizer`'s
    defining `_all_reduce_sum_gradients`."""

    def find():
        for cls in _public(path)().__mro__:
            if defining in vars(cls):
                return cls
        raise LookupError(f"no class in {path}.__mro__ defines {defining}")

    return find


def _module_of_class(find_class: Callable[[], type]) -> Callable[[], Any]:
    """The module a class found by `find_class` is defined in."""
    return lambda: sys.modules[find_class().__module__]


def _module(path: str) -> Callable[[], Any]:
    """The module at `path`: the last resort, where no public object leads to it."""
    return lambda: importlib.import_module(path)


def _first(*finders: Callable[[], Any]) -> Callable[[], Any]:
    """What the first finder that succeeds finds."""

    def find():
        error: Exception | None = None
        for finder in finders:
            try:
                return finder()
            except _NOT_FOUND as caught:
                error = caught
        raise LookupError("not found") from error

    return find


_NOT_FOUND = (ImportError, AttributeError, KeyError, LookupError)


@dataclasses.dataclass(frozen=True)
class Internal:
    """`name`, an attribute of what `find()` returns (`where` says what that is)."""

    where: str
    name: str
    why: str
    find: Callable[[], Any]


# Where Keras creates each of these, so that resolving one here and using it elsewhere agree.
_BACKEND_TRAINER = _class_in_mro("keras.Model", defining="make_train_function")
_TF_OPTIMIZER = _class_in_mro("keras.optimizers.Optimizer", defining="_all_reduce_sum_gradients")
_CONFIG = _first(_module_of("keras.config.backend"), _module("keras.src.backend.config"))
_GLOBAL_STATE = _first(
    _module_of("keras.utils.clear_session"), _module("keras.src.backend.common.global_state")
)
_RNG_UTILS = _first(_module_of("keras.utils.set_random_seed"), _module("keras.src.utils.rng_utils"))
_SEED_GENERATOR = _first(
    _module_of("keras.random.SeedGenerator"), _module("keras.src.random.seed_generator")
)
_LOSS = _first(_module_of("keras.losses.Loss"), _module("keras.src.losses.loss"))
_COMPILE_METRICS = _first(
    _globals_of("keras.Model.compile", "CompileMetrics"),
    lambda: _module("keras.src.trainers.compile_utils")().CompileMetrics,
)
_COMPILE_LOSS = _first(
    _globals_of("keras.Model.compile", "CompileLoss"),
    lambda: _module("keras.src.trainers.compile_utils")().CompileLoss,
)

# Module-level names and class attributes keras_accel reads or replaces. Instance attributes
# that Keras sets in __init__ are checked on the instance (`require`) where they are used.
REQUIRED: list[Internal] = [
    Internal("keras's config module", "keras_home", "where keras.json lives", _CONFIG),
    Internal("keras's global state", "set_global_attribute", "seeding", _GLOBAL_STATE),
    Internal("keras.utils.set_random_seed's module", "GLOBAL_RANDOM_SEED", "seeding", _RNG_UTILS),
    Internal(
        "keras.random.SeedGenerator's module", "GLOBAL_SEED_GENERATOR", "seeding", _SEED_GENERATOR
    ),
    Internal(
        "keras.Model", "_symbolic_build", "building a model from a batch", _public("keras.Model")
    ),
    Internal(
        "keras.layers.Layer",
        "_flatten_layers",
        "finding BatchNormalization layers",
        _public("keras.layers.Layer"),
    ),
    Internal(
        "keras.layers.BatchNormalization",
        "_moments",
        "BatchNormalization over real rows",
        _public("keras.layers.BatchNormalization"),
    ),
    Internal("CompileMetrics", "build", "masking compiled metrics", _COMPILE_METRICS),
    Internal("CompileLoss", "build", "per-output loss trackers", _COMPILE_LOSS),
    Internal("CompileLoss", "metrics", "per-output loss trackers", _COMPILE_LOSS),
    Internal("CompileMetrics", "metrics", "the compiled metrics", _COMPILE_METRICS),
    # keras_accel.callbacks: ModelCheckpoint extends Keras's through these hooks, and every
    # callback reads its model as `self._model` (Keras's `model` property syncs JAX state).
    Internal(
        "keras.callbacks.ModelCheckpoint",
        "_save_model",
        "ModelCheckpoint's chief-only save",
        _public("keras.callbacks.ModelCheckpoint"),
    ),
    Internal(
        "keras.callbacks.ModelCheckpoint",
        "_get_file_path",
        "ModelCheckpoint's file names",
        _public("keras.callbacks.ModelCheckpoint"),
    ),
    Internal(
        "keras.callbacks.ModelCheckpoint",
        "_should_save_model",
        "ModelCheckpoint's best value",
        _public("keras.callbacks.ModelCheckpoint"),
    ),
    Internal(
        "keras.callbacks.Callback()",
        "_model",
        "a callback's model",
        lambda: keras.callbacks.Callback(),
    ),
    # keras_accel.data.grain: a Grain data set reaches Keras as a DataAdapter of ours (Keras's
    # get_data_adapter takes any DataAdapter as it is), a fresh pass every epoch.
    Internal(
        "keras.utils.PyDataset's module",
        "DataAdapter",
        "Grain inputs, a fresh pass every epoch",
        _first(
            _module_of("keras.utils.PyDataset"),
            _module("keras.src.trainers.data_adapters.data_adapter"),
        ),
    ),
]
# Instance attributes read through `require` where they are used: `model._compile_metrics`
# (`_flat_metrics`, `_flat_weighted_metrics`), `model._compile_loss`, `model._loss_tracker`,
# `model._distribute_strategy` (TF), `BatchNormalization._reduction_axes`; and, in
# keras_accel.callbacks, `optimizer._learning_rate`, `_variables`, `_iterations`,
# `variable._layout` (JAX), `model._initial_epoch`, `ModelCheckpoint._current_epoch`, and
# Keras's BackupAndRestore file names.
# Only where TensorFlow is the backend (checked by `check()` then).
REQUIRED_TENSORFLOW: list[Internal] = [
    Internal(
        "keras.losses.Loss's module",
        "scale_loss_for_distribution",
        "global-batch losses on TF",
        _LOSS,
    ),
    Internal(
        "keras.losses.Loss's module",
        "unscale_loss_for_distribution",
        "global-batch losses on TF",
        _LOSS,
    ),
    Internal(
        "the TF optimizer base in keras.optimizers.Optimizer.__mro__",
        "_all_reduce_sum_gradients",
        "averaged gradients",
        _TF_OPTIMIZER,
    ),
    Internal(
        "the TF optimizer base in keras.optimizers.Optimizer.__mro__",
        "apply",
        "averaged gradients",
        _TF_OPTIMIZER,
    ),
    Internal(
        "keras.Model",
        "_maybe_symbolic_build",
        "building a model from a batch of strings",
        _public("keras.Model"),
    ),
    Internal(
        "the TF trainer's module (in keras.Model.__mro__)",
        "reduce_per_replica",
        "fused steps on TF; multi-worker logs",
        _module_of_class(_BACKEND_TRAINER),
    ),
]


class KerasInternalsError(RuntimeError):
    """A Keras internal that keras_accel relies on is missing from the installed Keras."""


def _error(where: str, name: str, why: str) -> KerasInternalsError:
    return KerasInternalsError(
        f"keras_accel relies on the Keras internal `{name}` of {where} ({why}), which Keras "
        f"{keras.__version__} does not have. keras_accel is tested with Keras "
        f"{TESTED_KERAS}: install the pinned versions with `pip install -c constraints.txt -e"
        f' ".[all]"`, or report this Keras version to keras_accel.'
    )


def _found(internal: Internal):
    """What holds `internal`, or a `KerasInternalsError` naming it and the Keras version."""
    try:
        target = internal.find()
    except _NOT_FOUND:
        raise _error(internal.where, internal.name, internal.why) from None
    if not hasattr(target, internal.name):
        raise _error(internal.where, internal.name, internal.why)
    return target


@functools.cache
def check() -> None:
    """Verify every internal in `REQUIRED` (and on TensorFlow `REQUIRED_TENSORFLOW`) once per
    process; raise `KerasInternalsError` naming the first one missing and the Keras version.

    Cheap after the first call (cached): `Accelerator.prepare` calls it, and so may anything
    that relies on the internals under a plain `model.fit` (keras_accel's callbacks).
    """
    required = list(REQUIRED)
    if keras.backend.backend() == "tensorflow":
        required += REQUIRED_TENSORFLOW
    for internal in required:
        _found(internal)


def require(obj, name: str, why: str):
    """`getattr(obj, name)`, or a `KerasInternalsError` naming the Keras version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error(type(obj).__qualname__, name, why) from None


def _holder(name: str):
    """What holds the listed internal `name` (the first entry of that name), found as
    `check()` finds it: what is used is what was checked."""
    internal = next(i for i in (*REQUIRED, *REQUIRED_TENSORFLOW) if i.name == name)
    return _found(internal)


def keras_home() -> str:
    """The Keras home directory that Keras chose at import (KERAS_HOME, ~/.keras or
    /tmp/.keras when the home directory is read-only)."""
    return _holder("keras_home").keras_home()


def needs_symbolic_build(model) -> bool:
    """Whether Keras would still build some of the model's state (layers, compiled metrics
    or losses) from the first batch."""
    compiled_metrics = getattr(model, "_compile_metrics", None)
    compiled_loss = getattr(model, "_compile_loss", None)
    return (
        not all(layer.built for layer in flatten_layers(model, include_self=False))
        or not model.built
        or (compiled_metrics is not None and not compiled_metrics.built)
        or (compiled_loss is not None and not compiled_loss.built)
        or (getattr(model, "optimizer", None) is not None and not model.optimizer.built)
    )


def install_symbolic_build(patches, model, first_batch, overrides_a_step: bool) -> None:
    """For the duration of `patches`, Keras builds `model` from `first_batch()`: the batch as
    the model's step sees it, not the Accelerator's batch with its row mask.

    A model whose layers are all built but which has no `call` of its own (a GAN that
    overrides `train_step` around two sub-models, as in Keras's guide) cannot be built
    symbolically; Keras fails there under any distribution. Such a model is left to build
    at its first step, as Keras does on one TensorFlow device, and only its optimizer is
    built here.
    """
    original = require(model, "_symbolic_build", "building a model from a batch")

    def build(iterator=None, data_batch=None):
        if not needs_symbolic_build(model):
            return None
        try:
            return original(data_batch=first_batch())
        except RuntimeError:
            inner = flatten_layers(model, include_self=False)
            if not overrides_a_step or not all(layer.built for layer in inner):
                raise
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        return None

    patches.set(model, "_symbolic_build", build)


def flatten_layers(model, include_self: bool = True) -> list:
    """Every layer of `model`, nested models included."""
    flatten = require(model, "_flatten_layers", "finding the layers of a model")
    return list(flatten(include_self=include_self, recursive=True))


def distribute_strategy_of(model):
    """The tf.distribute strategy a model was created under (None outside any)."""
    return require(model, "_distribute_strategy", "which strategy a model belongs to")


def loss_module():
    """Keras's loss helpers, whose replica scaling keras_accel replaces on TF."""
    return _holder("scale_loss_for_distribution")


def tf_optimizer_class():
    """The TensorFlow backend's optimizer class, which every Keras optimizer derives from on
    TF (in `keras.optimizers.Optimizer.__mro__`, the one defining `_all_reduce_sum_gradients`;
    `TFOptimizer` up to Keras 3.16 at least)."""
    return _holder("_all_reduce_sum_gradients")


def reduce_per_replica():
    """Keras's reduction of a step's per-replica logs (what its TF step functions apply)."""
    return tf_trainer_module().reduce_per_replica


def data_adapter_class() -> type:
    """Keras's `DataAdapter` base class (what `get_data_adapter` passes through as it is),
    found beside `keras.utils.PyDataset`'s adapter."""
    return _holder("DataAdapter").DataAdapter


def super_batch_iterator():
    """Keras 3.16's `data_adapter_utils.super_batch_iterator`: N batches stacked into one
    (what its JAX trainer asks a DataAdapter for under `steps_per_execution` > 1), found
    beside `keras.utils.PyDataset`'s adapter, which stacks its batches with it. Keras 3.15
    never asks for it, so it is not in the checked list: only a Keras that asks gets here."""
    utils = getattr(_module_of("keras.utils.PyDataset")(), "data_adapter_utils", None)
    function = getattr(utils, "super_batch_iterator", None)
    if function is None:
        raise _error(
            "keras.utils.PyDataset's module",
            "data_adapter_utils.super_batch_iterator",
            "steps_per_execution > 1 on JAX",
        )
    return function


def tf_trainer_module():
    """The module whose `reduce_per_replica` Keras's TF step functions call: the module of
    the TF trainer class in `keras.Model.__mro__` (the class defining `make_train_function`;
    `TensorFlowTrainer` in Keras 3.15, `Trainer` in 3.16)."""
    return _holder("reduce_per_replica")


def set_global_seed(seed: int) -> None:
    """What `keras.utils.set_random_seed` does to Keras's own state, without importing
    TensorFlow on a JAX run (Keras's version imports it wherever it is installed)."""
    global_state = _holder("set_global_attribute")
    global_state.set_global_attribute(_holder("GLOBAL_RANDOM_SEED").GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(_holder("GLOBAL_SEED_GENERATOR").GLOBAL_SEED_GENERATOR, None)


def global_seed_generator():
    """Keras's global SeedGenerator (what unseeded `keras.random` calls draw from), or None
    before anything created it."""
    global_state = _holder("set_global_attribute")
    return global_state.get_global_attribute(_holder("GLOBAL_SEED_GENERATOR").GLOBAL_SEED_GENERATOR)
