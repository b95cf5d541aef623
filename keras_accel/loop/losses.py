"""The custom loop's loss rule: each row's (weighted) loss, from a Keras `Loss` used
unreduced or a function, which every backend's step averages over the global batch's real
rows."""

from __future__ import annotations

import keras

from keras_accel.loop.weights import fits, static_shape, to_rank
from keras_accel.utils import keras_internals


def per_example_losses(loss, y_true, y_pred, weights=None):
    """The weighted loss of every row: `[batch]`, from a Keras `Loss` (used unreduced) or a
    function, times `weights`.

    A loss with one value per time step or pixel (sequence targets) is the mean of its
    row's values, weighted by per-step weights where `weights` has them (a temporal
    `(batch, steps)` weight); where the prediction carries a Keras mask
    (`Embedding(mask_zero=True)`), the mean over the row's unmasked steps.

    Weights weigh the loss's values as Keras weighs them: the values' shape or its first
    axes (`(rows,)` up to the values' shape; an axis of 1 broadcasts, one trailing axis of
    1 is squeezed). A loss with one value per row takes `(rows,)` or `(rows, 1)`; per-step
    weights `(rows, steps)` need a loss with one value per step.

    Raises:
        ValueError: the loss is a scalar (already reduced over the batch: padding and
            weights could not be accounted for), or its first axis is not the batch's, or
            the weights do not fit its values (per-step weights for a loss with one value
            per row broadcast into `(rows, rows)` before, or failed deep in the step); the
            message names both shapes.
    """
    from keras import ops

    step_mask = keras_internals.keras_mask(keras.tree.flatten(y_pred)[0])
    if isinstance(loss, keras.losses.Loss):
        # As Loss.__call__ does before its reduction: in the loss's dtype (float32 under a
        # mixed-precision policy, where predictions are float16 or bfloat16).
        dtype = loss.dtype or keras.config.floatx()
        y_pred = keras.tree.map_structure(lambda t: ops.cast(t, dtype), y_pred)
        values = loss.call(y_true, y_pred)
    else:
        values = loss(y_true, y_pred)
    # Losses are summed over the global batch in float32, whatever the compute dtype.
    values = ops.cast(ops.convert_to_tensor(values), "float32")
    rows = keras.tree.flatten(y_pred)[0].shape[0]
    if len(values.shape) == 0:
        raise ValueError(
            "The loss must return one loss per example (shape (batch,)), which keras_accel "
            "averages over the global batch, as tf.nn.compute_average_loss does. Received: "
            f"a scalar from {_name(loss)}. Pass a keras.losses.Loss (it is used unreduced), "
            "or a function that does not reduce over the batch."
        )
    if values.shape[0] is not None and rows is not None and values.shape[0] != rows:
        raise ValueError(
            f"The loss must return one loss per example: its first axis must be the "
            f"batch's, {rows} rows. Received: shape {tuple(values.shape)} from {_name(loss)}."
        )
    if weights is not None:
        _check_loss_weights(static_shape(values), static_shape(weights), loss)
        weights = ops.cast(weights, "float32")
    if len(values.shape) == 1:
        return values if weights is None else values * _row_weights(weights, values)
    # Per-timestep or per-pixel losses: their (weighted, unmasked) mean per example.
    axes = tuple(range(1, len(values.shape)))
    counted = ops.ones_like(values)
    if step_mask is not None and len(step_mask.shape) == len(values.shape):
        counted = ops.cast(step_mask, "float32")
    steps = ops.maximum(ops.sum(counted, axis=axes), 1.0)
    if weights is not None and len(weights.shape) > 1:
        counted = counted * to_rank(weights, len(values.shape))
        weights = None
    per = ops.sum(values * counted, axis=axes) / steps
    return per if weights is None else per * weights


def _check_loss_weights(values_shape: tuple, weights_shape: tuple, loss) -> None:
    """Raise where the weights cannot weigh the loss's values: per-step weights `(rows,
    steps)` for a loss with one value per row would broadcast into `(rows, rows)` or fail
    deep in the step."""
    if fits(weights_shape, values_shape):
        return
    rows = values_shape[0]
    if len(values_shape) == 1:
        what = (
            f"The loss returns one value per row, shape {values_shape}, from {_name(loss)}, and "
            f"the weights have shape {weights_shape}. A loss with one value per row takes "
            f"weights of shape ({rows},) or ({rows}, 1). Weights per step, (rows, steps), need "
            "a loss with one value per step: a Keras loss (the loop uses it unreduced, as "
            'reduction="none" gives) on a (rows, steps, classes) prediction, e.g. '
            "SparseCategoricalCrossentropy on (rows, steps) targets, or a function that "
            "returns (rows, steps)."
        )
    else:
        what = (
            f"The loss returns values of shape {values_shape} from {_name(loss)}, and the "
            f"weights have shape {weights_shape}. Weights must have the loss values' shape or "
            f"its first axes, (rows,) up to {values_shape} (an axis of 1 broadcasts, one "
            "trailing axis of 1 is squeezed)."
        )
    raise ValueError(f"{what} Pass sample_weight of a shape that fits the loss.")


def _row_weights(weights, values):
    """Weights for one loss per row: `(rows,)`, or `(rows, 1)` squeezed."""
    from keras import ops

    if len(weights.shape) == 2 and weights.shape[-1] == 1:
        return ops.squeeze(weights, axis=-1)
    return weights


def _name(loss) -> str:
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
