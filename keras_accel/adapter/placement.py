"""A model checked before a call (`Accelerator.prepare`): a `keras.Model`, on a Keras that has
every internal keras_accel relies on, and, where the Accelerator's scope lays variables out
over several devices, built and compiled inside it: each variable of the model, its
optimizer and the metric objects given to `compile` where the runtime would put it, or an
error naming the first that is not and where to make it."""

from __future__ import annotations

import keras

from keras_accel.utils import keras_internals


def check_is_model(model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model. Received: {type(model).__name__}")


def check(model, runtime, num_replicas: int) -> None:
    """Raise where `model` cannot run on `runtime` (see `Accelerator.prepare`)."""
    check_is_model(model)
    keras_internals.check_model(model)
    if runtime.native is None:
        return
    where = "`with acc.scope():` so its variables are laid out over the devices"
    name = f"{type(model).__name__} {model.name!r}"
    detail = runtime.model_misplaced(model)
    if detail is not None:
        raise RuntimeError(
            f"The model was built outside `acc.scope()`: {detail}, but this Accelerator "
            f"spreads work over {num_replicas} replicas. Build and compile {name} "
            f"inside {where}."
        )
    for stage, variables in _variables_by_stage(model):
        for variable in variables:
            detail = runtime.variable_misplaced(variable)
            if detail is not None:
                raise RuntimeError(
                    f"The model was {stage} outside `acc.scope()`: its variable "
                    f"{variable.path!r} {detail}, but this Accelerator spreads work over "
                    f"{num_replicas} replicas. "
                    + (
                        f"Compile {name} (again) inside "
                        if stage == "compiled"
                        else f"Build and compile {name} inside "
                    )
                    + f"{where}."
                )
    for metric in _compiled_metric_objects(model):
        for variable in metric.variables:
            detail = runtime.variable_misplaced(variable)
            if detail is not None:
                raise RuntimeError(
                    f"The metric {metric.name!r} given to compile() was created outside "
                    f"`acc.scope()`: its variable {variable.path!r} {detail}, but this "
                    f"Accelerator spreads work over {num_replicas} replicas. Create "
                    f"it inside `with acc.scope():`, or pass its name to compile()."
                )


def _variables_by_stage(model):
    """The model's variables by when they are made: building (layers) and compiling (the
    optimizer's, the metrics')."""
    yield "built", model.weights
    state = []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        state += list(optimizer.variables)
    for metric in model.metrics:
        state += list(metric.variables)
    yield "compiled", state


def _compiled_metric_objects(model) -> list:
    """The Metric objects given to `compile(metrics=..., weighted_metrics=...)`, which Keras
    keeps as they are (their variables exist before the first step)."""
    given = keras_internals.compiled_metric_arguments(model)
    return [m for m in keras.tree.flatten(given) if isinstance(m, keras.metrics.Metric)]
