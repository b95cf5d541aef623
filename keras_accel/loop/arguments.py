"""What a custom loop is built from: its optimizer, loss and metrics, as given to `acc.loop`
or as the model was compiled, resolved as Keras's `compile` resolves them (names, the
"accuracy" that depends on the targets, loss scaling under float16)."""

from __future__ import annotations

import keras
import numpy as np

from keras_accel.utils import keras_internals


def check_placed(accelerator, optimizer) -> None:
    """Raise where the optimizer's variables are not on the Accelerator's devices."""
    runtime = accelerator.runtime
    if runtime.native is None:
        return
    for variable in optimizer.variables:
        detail = runtime.variable_misplaced(variable)
        if detail is not None:
            raise RuntimeError(
                f"The optimizer was created outside `acc.scope()`: its variable "
                f"{variable.path!r} {detail}, but this Accelerator spreads work over "
                f"{accelerator.num_replicas} replicas. Create it inside `with acc.scope():`."
            )


def get_optimizer(model, optimizer, accelerator):
    """The optimizer given, else the compiled one; wrapped for loss scaling under float16."""
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "Accelerator.loop needs an optimizer: pass optimizer=..., or compile the model "
            "with one. Received: optimizer=None and an uncompiled model."
        )
    optimizer = keras.optimizers.get(optimizer)
    policy = keras.config.dtype_policy()
    float16 = "mixed_float16" in (accelerator.dtype_policy, policy.name)
    if float16 and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # float16 gradients underflow without loss scaling; bfloat16 needs none.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def get_loss(model, loss):
    """The loss given, else the compiled one; a name as `keras.losses.get` resolves it."""
    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError(
            "Accelerator.loop needs a loss: pass loss=... (a keras.losses.Loss, or a function "
            "of (y_true, y_pred) returning one loss per example). Received: loss=None."
        )
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if not callable(loss):
        raise TypeError(
            f"`loss` must be a keras.losses.Loss or a function of (y_true, y_pred). "
            f"Received: {loss!r} of type {type(loss).__name__}"
        )
    return loss


# Names `compile` resolves from the targets: a loop resolves them on its first batch.
BY_TARGETS = ("accuracy", "acc")


def compiled_metrics(model) -> tuple[list, list]:
    """The `metrics=` and `weighted_metrics=` the model was compiled with, as flat lists."""
    found = []
    for given in keras_internals.compiled_metric_arguments(model):
        if given is None:
            given = []
        if isinstance(given, dict) or any(isinstance(m, (list, tuple, dict)) for m in given):
            raise ValueError(
                "acc.loop applies each metric to the model's whole output, but the model was "
                f"compiled with metrics per output: {given!r}. Pass metrics=[...] (and "
                "weighted_metrics=[...]) to acc.loop for the output the loop's loss reads."
            )
        found.append(list(given))
    return found[0], found[1]


def metric_from_identifier(identifier):
    # As Keras's `compile` turns a name or a function into a metric.
    metric = keras.metrics.get(identifier)
    if not isinstance(metric, keras.metrics.Metric):
        name = identifier if isinstance(identifier, str) else getattr(metric, "__name__", None)
        metric = keras.metrics.MeanMetricWrapper(metric, name=name)
    return metric


def accuracy_for(name: str, y_true, y_pred, loss):
    # Keras's rule (compile_utils.is_binary_or_sparse_categorical) for "accuracy"; where the
    # outputs cannot be described without running the model, the loss says which labels.
    if y_pred is None:
        losses = keras.losses
        by_loss = {
            losses.SparseCategoricalCrossentropy: keras.metrics.SparseCategoricalAccuracy,
            losses.BinaryCrossentropy: keras.metrics.BinaryAccuracy,
            losses.CategoricalCrossentropy: keras.metrics.CategoricalAccuracy,
        }
        for kind, metric in by_loss.items():
            if isinstance(loss, kind):
                return metric(name=name)
        raise ValueError(
            f"The model was compiled with {name!r}, which Keras resolves from the shapes of "
            "the targets and the outputs, and the outputs of this model could not be worked "
            f"out from its inputs. Pass metrics=[...] to acc.loop. Received: loss={loss!r}."
        )
    y_true, y_pred = keras.tree.flatten(y_true)[0], keras.tree.flatten(y_pred)[0]
    true_shape, pred_shape = tuple(np.shape(y_true)), tuple(y_pred.shape)
    if pred_shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name=name)
    if len(true_shape) < len(pred_shape) or (true_shape[-1] == 1 and pred_shape[-1] > 1):
        return keras.metrics.SparseCategoricalAccuracy(name=name)
    return keras.metrics.CategoricalAccuracy(name=name)


def output_spec(model, x):
    """The model's output for a batch like `x`, symbolically (shapes and dtypes only)."""
    specs = keras.tree.map_structure(
        lambda a: keras.KerasTensor(np.shape(a), "string" if a.dtype.kind in "OUS" else a.dtype),
        x,
    )
    return model.compute_output_spec(specs)


def get_metric(metric):
    """A metric given to `acc.loop`: a `Metric`, or a name other than "accuracy"."""
    if isinstance(metric, keras.metrics.Metric):
        return metric
    if metric in ("accuracy", "acc"):
        # compile() picks the accuracy from the labels' and predictions' shapes; a loop is
        # told which one: integer labels, one-hot labels, or one probability per row.
        raise ValueError(
            f"Which accuracy depends on the labels: pass "
            f"keras.metrics.SparseCategoricalAccuracy('accuracy') (integer labels), "
            f"CategoricalAccuracy (one-hot) or BinaryAccuracy. Received: {metric!r}."
        )
    return keras.metrics.get(metric)
