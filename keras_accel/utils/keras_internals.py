"""Every Keras internal keras_accel touches, listed in one place and checked once.

keras_accel uses Keras's public API wherever Keras has one. Where it has no public extension
point, the private names below are what keras_accel relies on; `check()` verifies the
module-level and class-level ones against the installed Keras, once per process, and
`check_model(model)` the instance attributes on a model and its optimizer, once per class
(`Accelerator.prepare` calls both; keras_accel's callbacks call `check()` when made and
`check_model()` at `set_model`, so a plain `model.fit` is covered too). A Keras release that
renames one fails loudly, naming the Keras version and the name, instead of quietly doing
nothing. Code elsewhere reads these names through the accessors below only
(tests/utils/test_keras_internals_only.py reads the package's source to hold it to that).
The private names of other libraries (Python, torch, TensorFlow's own, JAX, Grain) are
listed beside this module, in `keras_accel.utils.library_internals`.

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

import contextlib
import dataclasses
import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import keras

from keras_accel.utils.library_internals import InternalsError
from keras_accel.utils.optimizers import inner_optimizer

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


def _loss_masking():
    """The module of the `get_keras_mask` that `keras.losses.Loss.__call__` reads a loss's
    mask with (3.15 calls `backend.get_keras_mask`, 3.16 imports the function itself): it
    defines `set_keras_mask` beside it."""
    found = _globals_of("keras.losses.Loss.__call__", "get_keras_mask")
    via_backend = _globals_of("keras.losses.Loss.__call__", "backend")
    function = _first(found, lambda: via_backend().get_keras_mask)()
    return sys.modules[function.__module__]


_LOSS_MASKING = _first(_loss_masking, _module("keras.src.backend.common.masking"))


def _data_adapters():
    """The package whose `get_data_adapter` Keras's epoch iterator calls, as a module
    attribute: the `data_adapters` of the module of a class in the TF trainer module's
    `TFEpochIterator` MRO (its base, `EpochIterator`)."""
    mro = _module_of_class(_BACKEND_TRAINER)().TFEpochIterator.__mro__
    return next(
        sys.modules[c.__module__].data_adapters
        for c in mro
        if hasattr(sys.modules[c.__module__], "data_adapters")
    )


_DATA_ADAPTERS = _first(_data_adapters, _module("keras.src.trainers.data_adapters"))
_COMPILE_METRICS = _first(
    _globals_of("keras.Model.compile", "CompileMetrics"),
    lambda: _module("keras.src.trainers.compile_utils")().CompileMetrics,
)
_COMPILE_LOSS = _first(
    _globals_of("keras.Model.compile", "CompileLoss"),
    lambda: _module("keras.src.trainers.compile_utils")().CompileLoss,
)

# Module-level names and class attributes keras_accel reads (it replaces none: `Patches`
# changes instances only). Instance attributes that Keras sets in __init__ are checked on
# the instance (`require`) where they are used.
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
    *(
        Internal(
            "keras.callbacks.ModelCheckpoint", name, why, _public("keras.callbacks.ModelCheckpoint")
        )
        for name, why in {
            "_save_model": "ModelCheckpoint's chief-only save",
            "_get_file_path": "ModelCheckpoint's file names",
            "_should_save_model": "ModelCheckpoint's best value",
            "_set_monitor_op": "ModelCheckpoint's best value in a backup",
            "_is_improvement": "ModelCheckpoint's best value in a backup",
        }.items()
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
# Instance attributes, which no class holds: Keras sets them in `__init__` (the model's in
# `Trainer.__init__`, the optimizer's in `BaseOptimizer.__init__`, a variable's in
# `KerasVariable.__init__`, a layer's graph nodes in `Operation.__init__`), so they are checked
# on the objects themselves: `check_model(model)` (each of keras_accel's callbacks at
# `set_model`, and `Accelerator.prepare`) checks these once per class, and each accessor below
# reads its own through `require`, which fails the same way at the call.
MODEL_ATTRIBUTES = {
    "_compile_loss": "the compiled loss",
    "_compile_metrics": "the compiled metrics",
    "_loss_tracker": "the loss tracker",
    "_initial_epoch": "where a restored fit starts",
    "_inbound_nodes": "a layer's calls",
    "_call_has_training_arg": "whether a layer's call takes `training`",
    "_compute_loss": "the loss Keras's step computes (a compiled torch step calls it)",
}
OPTIMIZER_ATTRIBUTES = {
    "_learning_rate": "the optimizer's learning rate as it holds it",
    "_variables": "the optimizer's variable list",
    "_iterations": "the optimizer's iteration count",
}
VARIABLE_ATTRIBUTES = {"_layout": "a variable's layout over the device mesh"}
# Only where TensorFlow is the backend (checked by `check()` then).
REQUIRED_TENSORFLOW: list[Internal] = [
    Internal(
        "the TF optimizer base in keras.optimizers.Optimizer.__mro__",
        "_all_reduce_sum_gradients",
        "the replicas' gradients summed before clipping",
        _TF_OPTIMIZER,
    ),
    Internal(
        "keras.Model",
        "_compute_loss",
        "the loss a custom step reports on TF",
        _public("keras.Model"),
    ),
    Internal(
        "keras.Model",
        "_aggregate_additional_loss",
        "the regularization losses a class's own compute_loss sees on TF",
        _public("keras.Model"),
    ),
    Internal(
        "the module of keras.losses.Loss.__call__'s get_keras_mask",
        "get_keras_mask",
        "a loss's mask, kept where its values are rescaled",
        _LOSS_MASKING,
    ),
    Internal(
        "the module of keras.losses.Loss.__call__'s get_keras_mask",
        "set_keras_mask",
        "a loss's mask, kept where its values are rescaled",
        _LOSS_MASKING,
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
        "fused steps on TF",
        _module_of_class(_BACKEND_TRAINER),
    ),
    Internal(
        "the data adapters package of the TF trainer's epoch iterator",
        "get_data_adapter",
        "a PyDataset or a generator over several TF replicas",
        _DATA_ADAPTERS,
    ),
]


class KerasInternalsError(InternalsError):
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


@contextlib.contextmanager
def tensorflow_left_unimported():
    """Within: Keras's serialization (`get_config` of a model, a layer, an optimizer) does not
    import TensorFlow on another backend.

    `serialize_keras_object` asks its lazy `tensorflow` module whether TensorFlow is
    installed (`tf.available`, to recognise a `tf.TensorShape`), and asking imports it:
    measured in a torch process, 150 MB of memory and 3 s, for a fingerprint of the model
    (`keras_accel.adapter.choice_cache`). Where TensorFlow is not imported yet no object can
    be one of its types, so the lazy module is told it is unavailable for the duration, and
    put back after (`LazyModule._available`, reset to "not asked yet"). Optional: a Keras
    without that module or attribute is left as it is (TensorFlow imported, as before)."""
    lazy = None
    if "tensorflow" not in sys.modules:
        try:
            lazy = importlib.import_module("keras.src.utils.module_utils").tensorflow
        except (ImportError, AttributeError):
            lazy = None
        if getattr(lazy, "_available", True) is not None:
            lazy = None  # Already asked (or not Keras's lazy module): nothing to hold off.
    if lazy is None:
        yield
        return
    lazy._available = False
    try:
        yield
    finally:
        lazy._available = None  # As it was: asked again at the next use.


def keras_home() -> str:
    """The Keras home directory that Keras chose at import (KERAS_HOME, ~/.keras or
    /tmp/.keras when the home directory is read-only)."""
    return _holder("keras_home").keras_home()


def needs_symbolic_build(model) -> bool:
    """Whether Keras would still build some of the model's state (layers, compiled metrics
    or losses) from the first batch."""
    compiled_metrics = compile_metrics(model)
    compiled_loss = compile_loss(model)
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


def reduce_per_replica():
    """Keras's reduction of a step's per-replica logs (what its TF step functions apply)."""
    return tf_trainer_module().reduce_per_replica


def data_adapter_class() -> type:
    """Keras's `DataAdapter` base class (what `get_data_adapter` passes through as it is),
    found beside `keras.utils.PyDataset`'s adapter."""
    return _holder("DataAdapter").DataAdapter


def get_data_adapter():
    """Keras's `get_data_adapter`: the adapter its trainers make for an input (a
    `PyDataset`'s, a generator's), so that keras_accel can hand the TF trainer that input's
    pipeline already distributed (`keras_accel.adapter.backends.tensorflow.runtime.
    KerasRouteAdapter`)."""
    return _holder("get_data_adapter").get_data_adapter


def keras_scans_steps() -> bool:
    """Whether Keras's own JAX trainer runs `steps_per_execution` > 1 steps in one compiled
    scan (Keras 3.16: keras-team/keras#23527), rather than as a host loop of the one-step
    program (Keras 3.15). Read from the public contract that release changed: its
    `DataAdapter.get_jax_iterator(super_batch=None)` asks an adapter for stacked groups."""
    get_jax_iterator = data_adapter_class().get_jax_iterator
    return "super_batch" in inspect.signature(get_jax_iterator).parameters


def _data_adapter_utils():
    """Keras's `data_adapter_utils`, found beside `keras.utils.PyDataset`'s adapter (which
    stacks its groups with it); None where that module does not import it."""
    return getattr(_module_of("keras.utils.PyDataset")(), "data_adapter_utils", None)


def super_batch_iterator():
    """Keras 3.16's `data_adapter_utils.super_batch_iterator`: N batches stacked into one,
    the short last group as a `PartialBatchList` (what its JAX trainer tells apart). Keras
    has no public name for either. Only a Keras that asks (`keras_scans_steps()`) gets here,
    so it is not in the checked list, which 3.15 must pass."""
    function = getattr(_data_adapter_utils(), "super_batch_iterator", None)
    if function is None:
        raise _error(
            "keras.utils.PyDataset's module",
            "data_adapter_utils.super_batch_iterator",
            "steps_per_execution > 1 on JAX",
        )
    return function


def is_partial_batch_list(item) -> bool:
    """Whether `item` is Keras 3.16's `PartialBatchList`: the batches of a short last group,
    which its JAX epoch iterator yields as a list where full groups come stacked."""
    kind = getattr(_data_adapter_utils(), "PartialBatchList", None)
    return kind is not None and isinstance(item, kind)


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


# ---------------------------------------------------------------- instance attributes
# Each accessor below was checked against Keras 3.15 and 3.16 (`TESTED_KERAS`): it reads the
# attribute through `require`, so a Keras without it fails here, naming the version, never
# with a silent default. Where None is returned, it is Keras's own value for "not yet".

_CHECKED_CLASSES: set = set()


def check_model(model) -> None:
    """Verify the instance attributes keras_accel reads on `model`, its optimizer and the
    optimizer's iteration count (`MODEL_ATTRIBUTES`, `OPTIMIZER_ATTRIBUTES`,
    `VARIABLE_ATTRIBUTES`), once per class; raise `KerasInternalsError` naming the first one
    missing and the Keras version. Runs `check()` too.

    keras_accel's callbacks call it at `set_model`, so that a plain `model.fit` with them on
    an untested Keras fails before its first step, not at the epoch that first reads one.
    """
    check()
    if model is None:
        return  # A callback list built without a model: nothing to check on it yet.

    checks = [(model, MODEL_ATTRIBUTES)]
    optimizer = inner_optimizer(getattr(model, "optimizer", None))
    # No optimizer yet (an uncompiled model), or one that is not Keras's: nothing to check.
    if isinstance(optimizer, keras.optimizers.Optimizer):
        checks.append((optimizer, OPTIMIZER_ATTRIBUTES))
        checks.append((iteration_variable(optimizer), VARIABLE_ATTRIBUTES))
    for obj, names in checks:
        if type(obj) not in _CHECKED_CLASSES:
            for name, why in names.items():
                require(obj, name, why)
            _CHECKED_CLASSES.add(type(obj))


def compile_loss(model):
    """The model's `CompileLoss` (`model._compile_loss`): None until it is compiled with a
    loss."""
    return require(model, "_compile_loss", MODEL_ATTRIBUTES["_compile_loss"])


def compile_metrics(model):
    """The model's `CompileMetrics` (`model._compile_metrics`): None until it is compiled
    with metrics."""
    return require(model, "_compile_metrics", MODEL_ATTRIBUTES["_compile_metrics"])


def compiled_metric_arguments(model) -> tuple:
    """`(metrics, weighted_metrics)` as given to `model.compile` (Keras keeps the objects
    as they are), each None where none was given; `(None, None)` for a model compiled
    without metrics."""
    compiled = compile_metrics(model)
    if compiled is None:
        return None, None
    why = "the metrics a model was compiled with"
    return require(compiled, "_user_metrics", why), require(compiled, "_user_weighted_metrics", why)


def built_compiled_metrics(compiled) -> tuple[list, list]:
    """`(metrics, weighted_metrics)` of a built `CompileMetrics`, one flat list each, as
    Keras updates them (`_flat_metrics`, `_flat_weighted_metrics`; None for an output
    without)."""
    return (
        require(compiled, "_flat_metrics", "the unweighted metrics"),
        require(compiled, "_flat_weighted_metrics", "the weighted metrics"),
    )


def loss_tracker(model):
    """The `Mean` the model averages its loss in (`model._loss_tracker`): None until it is
    compiled."""
    return require(model, "_loss_tracker", MODEL_ATTRIBUTES["_loss_tracker"])


def call_has_training_arg(model) -> bool:
    """Whether the model's `call` takes `training` (Keras's steps pass it only then)."""
    return require(model, "_call_has_training_arg", MODEL_ATTRIBUTES["_call_has_training_arg"])


def compute_loss_of(model) -> Callable:
    """The model's `_compute_loss`: `compute_loss`, or the user's override of it, as
    Keras's steps call it."""
    return require(model, "_compute_loss", MODEL_ATTRIBUTES["_compute_loss"])


def initial_epoch(model) -> int | None:
    """The epoch Keras's `fit` starts at instead of its `initial_epoch` argument (what a
    restore sets; `model._initial_epoch`): None when nothing set one."""
    return require(model, "_initial_epoch", MODEL_ATTRIBUTES["_initial_epoch"])


def set_initial_epoch(model, epoch: int | None) -> None:
    """Make the next `fit` start at `epoch` (None: at its `initial_epoch` argument). The
    attribute must exist: writing a name Keras no longer reads would do nothing."""
    initial_epoch(model)
    model._initial_epoch = epoch


def inbound_nodes(layer) -> list:
    """The graph nodes of each call of `layer` in a functional model (`layer._inbound_nodes`;
    more than one for a shared layer)."""
    return list(require(layer, "_inbound_nodes", MODEL_ATTRIBUTES["_inbound_nodes"]))


def batchnorm_reduction_axes(layer) -> list:
    """The axes a BatchNormalization layer averages over (`_reduction_axes`, set when it is
    built)."""
    return require(layer, "_reduction_axes", "BatchNormalization's axes")


def batchnorm_moments(layer) -> Callable:
    """A BatchNormalization layer's `_moments(inputs, mask)`: its batch mean and variance."""
    return require(layer, "_moments", "BatchNormalization over real rows")


def replace_batchnorm_moments(patches, layer, moments: Callable) -> None:
    """For the duration of `patches`, `layer` computes its batch moments with
    `moments(inputs, mask)` (a bound method)."""
    batchnorm_moments(layer)
    patches.set(layer, "_moments", moments)


def learning_rate_of(optimizer):
    """The learning rate as the optimizer holds it (`_learning_rate`): a variable (built
    with a float), a `LearningRateSchedule` or a callable. The public `learning_rate`
    evaluates it instead."""
    return require(optimizer, "_learning_rate", OPTIMIZER_ATTRIBUTES["_learning_rate"])


# The optimizer attribute that holds its learning rate (a float, a schedule or a variable),
# for code that must set it for a while without Keras's setter (see set_learning_rate_of).
LEARNING_RATE = "_learning_rate"


def set_learning_rate_of(optimizer, rate) -> None:
    """Hold `rate` as the optimizer's learning rate as it is: unlike Keras's setter, which
    assigns a float to the variable it has, or replaces it and untracks it."""
    learning_rate_of(optimizer)
    optimizer._learning_rate = rate


def patch_learning_rate_of(patches, optimizer, rate) -> None:
    """`set_learning_rate_of`, for the duration of `patches`."""
    learning_rate_of(optimizer)
    patches.set(optimizer, "_learning_rate", rate)


def optimizer_variables(optimizer) -> list:
    """The optimizer's own variable list (`_variables`; the public `variables` is a copy):
    edits here are what `variables`, saving and loading see."""
    return require(optimizer, "_variables", OPTIMIZER_ATTRIBUTES["_variables"])


def iteration_variable(optimizer):
    """The optimizer's iteration-count variable itself (`_iterations`; the public
    `iterations` divides it under gradient accumulation)."""
    return require(optimizer, "_iterations", OPTIMIZER_ATTRIBUTES["_iterations"])


def variable_layout(variable):
    """A Keras variable's layout over the device mesh (`_layout`): None where no
    distribution laid it out (and on backends without layouts)."""
    return require(variable, "_layout", VARIABLE_ATTRIBUTES["_layout"])


def set_variable_layout(variable, layout) -> None:
    """Lay `variable` out as `layout` (JAX: the next assignment places it there)."""
    variable_layout(variable)
    variable._layout = layout


def monitor_improves(callback, current, reference) -> bool:
    """Whether `current` improves on `reference` by a Keras monitor callback's own rule
    (`_is_improvement`: its mode, its `min_delta`), its direction set first as Keras sets
    it at the first epoch's end (`_set_monitor_op`)."""
    if callback.monitor_op is None:
        _holder("_set_monitor_op")._set_monitor_op(callback)
    return bool(_holder("_is_improvement")._is_improvement(callback, current, reference))


def callback_model(callback):
    """The model a callback was given (`_model`), without Keras's `model` property, which
    on JAX first syncs the trainer's state into the model's variables."""
    return require(callback, "_model", "a callback's model")


@functools.cache
def _loss_function_wrapper() -> type:
    """Keras's `LossFunctionWrapper` (not exported): the class in the MRO of the public
    `keras.losses.MeanSquaredError` whose `__init__` takes the `fn` it wraps."""
    for cls in keras.losses.MeanSquaredError.__mro__:
        if "fn" in inspect.signature(vars(cls).get("__init__", lambda: None)).parameters:
            return cls
    raise _error(
        "a class in keras.losses.MeanSquaredError.__mro__",
        "__init__(fn)",
        "the function a built-in loss applies",
    )


def wrapped_function(obj):
    """The function a Keras loss or metric wrapper applies: `fn` of a `LossFunctionWrapper`
    (every built-in function loss), `_fn` of a `keras.metrics.MeanMetricWrapper`; None for
    any other object, which wraps nothing."""
    if isinstance(obj, keras.metrics.MeanMetricWrapper):
        return require(obj, "_fn", "the function a metric wrapper applies")
    if isinstance(obj, _loss_function_wrapper()):
        return obj.fn
    return None


def wrapped_kwargs(obj) -> dict:
    """The keyword arguments a Keras loss or metric wrapper passes its function
    (`_fn_kwargs`); {} for any other object."""
    if isinstance(obj, (keras.metrics.MeanMetricWrapper, _loss_function_wrapper())):
        return dict(require(obj, "_fn_kwargs", "the arguments a wrapped loss is called with"))
    return {}


def replace_tf_symbolic_build(patches, model) -> None:
    """TF: for the duration of `patches`, the trainer's `_maybe_symbolic_build` (which builds
    from a batch it reduces across replicas first) builds through `model._symbolic_build`
    (`install_symbolic_build`'s, from the batch the model's step sees)."""
    require(model, "_maybe_symbolic_build", "the TF trainer's build")
    symbolic_build = require(model, "_symbolic_build", "building a model from a batch")

    def build(iterator=None, data_batch=None):
        symbolic_build()

    patches.set(model, "_maybe_symbolic_build", build)


def replace_all_reduce_sum_gradients(patches, optimizer, function: Callable) -> None:
    """TF: for the duration of `patches`, `optimizer` (the instance) reduces its gradients
    across replicas with `function(grads_and_vars)` instead of Keras's sum."""
    require(optimizer, "_all_reduce_sum_gradients", "the replicas' gradients summed")
    patches.set(optimizer, "_all_reduce_sum_gradients", function)


def replace_compute_loss(patches, model, make: Callable) -> None:
    """For the duration of `patches`, `model`'s loss goes through `make(keras_compute_loss,
    compute_loss)`'s pair: the first is what Keras's own steps call (`_compute_loss`, which
    then calls `compute_loss`), the second what a custom step calls (`compute_loss`)."""
    keras_step_loss = require(model, "_compute_loss", "the loss a custom step reports on TF")
    in_keras_step, compute_loss = make(keras_step_loss, model.compute_loss)
    patches.set(model, "_compute_loss", in_keras_step)
    patches.set(model, "compute_loss", compute_loss)


def step_aside_from_keras_ddp(patches, model) -> Callable | None:
    """Keras 3.16's torch trainer wraps the model in `DistributedDataParallel` whenever a
    process group exists (`_initialize_ddp`) and sums every metric variable over the
    processes in its own `get_metrics_result`. The Accelerator averages the gradients once
    and reduces metrics by each variable's aggregation itself: for the duration of
    `patches` Keras's wrapping is skipped. Returns the trainer-independent
    `get_metrics_result` (Keras's base trainer's, which reads each metric's `result()`) where
    Keras's torch trainer overrides it, else None. Keras 3.15 has neither: nothing is
    changed."""
    if not hasattr(type(model), "_initialize_ddp"):
        return None
    if getattr(model, "ddp_model", None) is not None:
        raise RuntimeError(
            f"This model was wrapped in DistributedDataParallel by a plain model.fit in a "
            f"process group (Keras {keras.__version__}); the Accelerator averages the "
            "gradients itself and would reduce them twice. Train it through the "
            "Accelerator only, or build it again."
        )
    patches.set(model, "_initialize_ddp", lambda: None)
    for klass in type(model).__mro__:
        if "get_metrics_result" in vars(klass) and not hasattr(klass, "_initialize_ddp"):
            return vars(klass)["get_metrics_result"].__get__(model)
    return None


def replace_step_and_added_losses(patches, model, step: Callable, added: Callable) -> None:
    """For the duration of `patches`: Keras's step computes its loss through
    `step(model._compute_loss)`, and Keras's `compute_loss` sums each added loss
    (regularizers, `add_loss`; TF divides each by the replica count) through
    `added(model._aggregate_additional_loss)`."""
    keras_step_loss = require(model, "_compute_loss", "the loss a custom step reports on TF")
    aggregate = require(
        model,
        "_aggregate_additional_loss",
        "the regularization losses a class's own compute_loss sees on TF",
    )
    patches.set(model, "_aggregate_additional_loss", added(aggregate))
    patches.set(model, "_compute_loss", step(keras_step_loss))


def compiled_losses(compile_loss) -> list:
    """The loss objects a built `CompileLoss` applies, one per output (`_flat_losses`: each
    `(path, loss, weight, name)`; functions are wrapped as Keras loss objects there)."""
    return [loss for _, loss in compiled_loss_paths(compile_loss)]


def compiled_loss_paths(compile_loss) -> list:
    """`(path, loss)` for each loss a built `CompileLoss` applies: `path` is the output's
    path in the prediction's structure, as `keras.tree.flatten_with_path` gives it (`()` for
    a single output)."""
    flat = require(compile_loss, "_flat_losses", "the compiled losses") or []
    return [(tuple(entry[0]), entry[1]) for entry in flat]


def keras_mask(tensor):
    """The Keras mask a tensor carries (what `keras.losses.Loss` reads from its values)."""
    return _LOSS_MASKING().get_keras_mask(tensor)


def set_keras_mask(tensor, mask) -> None:
    """Give `tensor` the Keras mask `mask` (None: none)."""
    _LOSS_MASKING().set_keras_mask(tensor, mask)


def calling_callback_list(callback):
    """The `keras.callbacks.CallbackList` whose hook is calling `callback`'s, or None where
    none is (hooks called directly).

    Keras hands a callback the model and `params`, never its siblings, and `fit` keeps its
    CallbackList to itself; the list dispatches each hook from one of its own methods, so
    the list is the `self` of a frame just above this hook (one more where a subclass wraps
    the dispatch, as `Accelerator.loop`'s does). Checked against Keras 3.15's CallbackList,
    which calls each callback's hook from its own method of the same name.
    """
    frame = inspect.currentframe().f_back
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList) and any(
            each is callback for each in owner.callbacks
        ):
            return owner
        frame = frame.f_back
    return None
