"""Every Keras internal keras_accel touches, listed in one place and checked once.

keras_accel uses Keras's public API wherever Keras has one. Where it has no public extension
point, the private names listed here are what keras_accel relies on; `check()` verifies the
module-level and class-level ones against the installed Keras, once per process, and
`check_model(model)` the instance attributes on a model and its optimizer, once per class
(`Accelerator.prepare` calls both; keras_accel's callbacks call `check()` when made and
`check_model()` at `set_model`, so a plain `model.fit` is covered too). A Keras release that
renames one fails loudly, naming the Keras version and the name, instead of quietly doing
nothing. Code elsewhere reads these names through the accessors re-exported here only
(`keras_internals.<accessor>`; tests/utils/test_keras_internals_only.py reads the package's
source to hold it to that). The private names of other libraries (Python, torch, TensorFlow's
own, JAX, Grain) are listed beside this package, in `keras_accel.utils.library_internals`.

One module per Keras area it reaches into, each listing its internals (`REQUIRED`,
`REQUIRED_TENSORFLOW`, its instance attributes) beside their accessors:

- `lookup`: how an internal is found (by what it is, not by a module path) and the error;
- `trainers`: `keras.Model`'s trainer classes: symbolic build, loss hooks, the TF trainer's
  module, Keras 3.16's torch DDP;
- `compile_utils`: the `CompileLoss` and `CompileMetrics` a compiled model holds;
- `layers`: nested layers, a layer's graph nodes, BatchNormalization's moments;
- `optimizers`: an optimizer's learning rate, variables and iteration count, a variable's
  layout, the TF optimizer's gradient sum;
- `losses`: the Keras mask a loss reads, what a loss or metric wrapper applies;
- `callbacks`: ModelCheckpoint's hooks, a callback's model, the calling CallbackList;
- `data_adapters`: the `DataAdapter` base, `get_data_adapter`, Keras 3.16's stacked groups;
- `global_state`: the Keras home directory and the global seed;
- `serialization`: the lazy TensorFlow module Keras's serialization asks;
- `torch_variables`: a torch variable's tensor, read from elsewhere for a call (fsdp), and
  the torch parameters its layers register.

This module holds the whole list and the check at first use: `check()` and `check_model()`
read `REQUIRED`, `REQUIRED_TENSORFLOW` and the `*_ATTRIBUTES` tables from here.
"""

from __future__ import annotations

import functools

import keras

from keras_accel.utils.keras_internals import (
    callbacks,
    compile_utils,
    data_adapters,
    global_state,
    layers,
    lookup,
    losses,
    optimizers,
    trainers,
)
from keras_accel.utils.keras_internals.callbacks import (
    callback_model,
    calling_callback_list,
    monitor_improves,
)
from keras_accel.utils.keras_internals.compile_utils import (
    built_compiled_metrics,
    compile_loss,
    compile_metrics,
    compiled_loss_paths,
    compiled_losses,
    compiled_metric_arguments,
    loss_tracker,
)
from keras_accel.utils.keras_internals.data_adapters import (
    data_adapter_class,
    get_data_adapter,
    is_partial_batch_list,
    keras_scans_steps,
    super_batch_iterator,
)
from keras_accel.utils.keras_internals.global_state import (
    global_seed_generator,
    keras_home,
    set_global_seed,
)
from keras_accel.utils.keras_internals.layers import (
    batchnorm_moments,
    batchnorm_reduction_axes,
    call_has_training_arg,
    flatten_layers,
    inbound_nodes,
    replace_batchnorm_moments,
)
from keras_accel.utils.keras_internals.lookup import (
    TESTED_KERAS,
    Internal,
    KerasInternalsError,
    require,
)
from keras_accel.utils.keras_internals.losses import (
    keras_mask,
    set_keras_mask,
    wrapped_function,
    wrapped_kwargs,
)
from keras_accel.utils.keras_internals.optimizers import (
    LEARNING_RATE,
    OPTIMIZER_ATTRIBUTES,
    VARIABLE_ATTRIBUTES,
    iteration_variable,
    learning_rate_of,
    optimizer_variables,
    patch_learning_rate_of,
    replace_all_reduce_sum_gradients,
    set_learning_rate_of,
    set_variable_layout,
    variable_layout,
)
from keras_accel.utils.keras_internals.serialization import tensorflow_left_unimported
from keras_accel.utils.keras_internals.torch_variables import (
    layers_torch_params,
    raw_value,
    read_value_through,
    retrack_torch_params,
    stop_reading_through,
)
from keras_accel.utils.keras_internals.trainers import (
    MODEL_ATTRIBUTES,
    compute_loss_of,
    distribute_strategy_of,
    initial_epoch,
    install_symbolic_build,
    needs_symbolic_build,
    reduce_per_replica,
    replace_added_losses,
    replace_compute_loss,
    replace_tf_symbolic_build,
    set_initial_epoch,
    step_aside_from_keras_ddp,
    tf_trainer_module,
)
from keras_accel.utils.optimizers import inner_optimizer

# Module-level names and class attributes keras_accel reads (it replaces none: `Patches`
# changes instances only), in one list for `check()`. Instance attributes that Keras sets in
# __init__ are checked on the instance (`require`) where they are used.
REQUIRED: list[Internal] = [
    *global_state.REQUIRED,
    *trainers.REQUIRED,
    *layers.REQUIRED,
    *compile_utils.REQUIRED,
    *callbacks.REQUIRED,
    *data_adapters.REQUIRED,
]
# Only where TensorFlow is the backend (checked by `check()` then).
REQUIRED_TENSORFLOW: list[Internal] = [
    *optimizers.REQUIRED_TENSORFLOW,
    *trainers.REQUIRED_TENSORFLOW,
    *losses.REQUIRED_TENSORFLOW,
    *data_adapters.REQUIRED_TENSORFLOW,
]


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
        lookup.holder(internal)


# ---------------------------------------------------------------- instance attributes
# Instance attributes, which no class holds: Keras sets them in `__init__` (the model's in
# `Trainer.__init__`, the optimizer's in `BaseOptimizer.__init__`, a variable's in
# `KerasVariable.__init__`, a layer's graph nodes in `Operation.__init__`), so they are
# checked on the objects themselves, once per class. Each accessor was checked against Keras
# 3.15 and 3.16 (`TESTED_KERAS`): it reads the attribute through `require`, so a Keras
# without it fails there, naming the version, never with a silent default. Where None is
# returned, it is Keras's own value for "not yet".

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
        # `iteration_variable(optimizer)`, read through this module's `require`.
        iterations = require(optimizer, "_iterations", OPTIMIZER_ATTRIBUTES["_iterations"])
        checks.append((iterations, VARIABLE_ATTRIBUTES))
    for obj, names in checks:
        if type(obj) not in _CHECKED_CLASSES:
            for name, why in names.items():
                require(obj, name, why)
            _CHECKED_CLASSES.add(type(obj))


__all__ = [
    "LEARNING_RATE",
    "MODEL_ATTRIBUTES",
    "OPTIMIZER_ATTRIBUTES",
    "REQUIRED",
    "REQUIRED_TENSORFLOW",
    "TESTED_KERAS",
    "VARIABLE_ATTRIBUTES",
    "Internal",
    "KerasInternalsError",
    "batchnorm_moments",
    "batchnorm_reduction_axes",
    "built_compiled_metrics",
    "call_has_training_arg",
    "callback_model",
    "calling_callback_list",
    "check",
    "check_model",
    "compile_loss",
    "compile_metrics",
    "compiled_loss_paths",
    "compiled_losses",
    "compiled_metric_arguments",
    "compute_loss_of",
    "data_adapter_class",
    "distribute_strategy_of",
    "flatten_layers",
    "get_data_adapter",
    "global_seed_generator",
    "inbound_nodes",
    "initial_epoch",
    "install_symbolic_build",
    "is_partial_batch_list",
    "iteration_variable",
    "keras_home",
    "keras_mask",
    "keras_scans_steps",
    "learning_rate_of",
    "loss_tracker",
    "monitor_improves",
    "needs_symbolic_build",
    "optimizer_variables",
    "patch_learning_rate_of",
    "reduce_per_replica",
    "replace_added_losses",
    "replace_all_reduce_sum_gradients",
    "raw_value",
    "read_value_through",
    "replace_batchnorm_moments",
    "layers_torch_params",
    "retrack_torch_params",
    "stop_reading_through",
    "replace_compute_loss",
    "replace_tf_symbolic_build",
    "require",
    "set_global_seed",
    "set_initial_epoch",
    "set_keras_mask",
    "set_learning_rate_of",
    "set_variable_layout",
    "step_aside_from_keras_ddp",
    "super_batch_iterator",
    "tensorflow_left_unimported",
    "tf_trainer_module",
    "variable_layout",
    "wrapped_function",
    "wrapped_kwargs",
]
