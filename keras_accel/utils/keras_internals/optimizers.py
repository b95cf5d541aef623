"""Keras's optimizers and their variables: what `BaseOptimizer.__init__` sets on an optimizer
(its learning rate as held, its variable list, its iteration count), a variable's layout
(`KerasVariable.__init__`), and the TF optimizer base's gradient sum over replicas."""

from __future__ import annotations

from collections.abc import Callable

from keras_accel.utils.keras_internals.lookup import Internal, class_in_mro, require

# Checked by `keras_internals.check()` where TensorFlow is the backend.
REQUIRED_TENSORFLOW = [
    Internal(
        "the TF optimizer base in keras.optimizers.Optimizer.__mro__",
        "_all_reduce_sum_gradients",
        "the replicas' gradients summed before clipping",
        class_in_mro("keras.optimizers.Optimizer", defining="_all_reduce_sum_gradients"),
    ),
]
# Instance attributes, which no class holds, checked on the objects themselves by
# `keras_internals.check_model`: the optimizer's, and its iteration count's (a variable).
OPTIMIZER_ATTRIBUTES = {
    "_learning_rate": "the optimizer's learning rate as it holds it",
    "_variables": "the optimizer's variable list",
    "_iterations": "the optimizer's iteration count",
}
VARIABLE_ATTRIBUTES = {"_layout": "a variable's layout over the device mesh"}

# The optimizer attribute that holds its learning rate (a float, a schedule or a variable),
# for code that must set it for a while without Keras's setter (see set_learning_rate_of).
LEARNING_RATE = "_learning_rate"


def learning_rate_of(optimizer):
    """The learning rate as the optimizer holds it (`_learning_rate`): a variable (built
    with a float), a `LearningRateSchedule` or a callable. The public `learning_rate`
    evaluates it instead."""
    return require(optimizer, "_learning_rate", OPTIMIZER_ATTRIBUTES["_learning_rate"])


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


def replace_all_reduce_sum_gradients(patches, optimizer, function: Callable) -> None:
    """TF: for the duration of `patches`, `optimizer` (the instance) reduces its gradients
    across replicas with `function(grads_and_vars)` instead of Keras's sum."""
    require(optimizer, "_all_reduce_sum_gradients", "the replicas' gradients summed")
    patches.set(optimizer, "_all_reduce_sum_gradients", function)
