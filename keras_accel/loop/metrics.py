"""The custom loop's metric updates: the loss tracker, the metrics and the weighted metrics
updated with one batch's real rows (the row mask, and the sample weights for the weighted
ones), as every backend's step applies them."""

from __future__ import annotations

import keras

from keras_accel.loop.weights import fits, static_shape, to_rank
from keras_accel.utils import keras_internals


def metric_updates(loop, y_true, y_pred, per_example, weights, mask):
    """`(metric, args, sample_weight)` for each of the loop's metrics, in `all_metrics()`
    order: what every backend's step updates them with. The loss tracker averages the
    weighted per-example losses (`per_example_losses(..., weights)`) over the real rows;
    metrics count the real rows; weighted metrics weigh them by the sample weights too.
    Padding rows count nowhere.

    Raises:
        ValueError: there are weighted metrics and the weights do not fit the prediction
            (per-step weights `(rows, steps)` for a prediction per row, `(rows, classes)`).
    """
    from keras import ops

    yield loop.loss_tracker, (per_example,), mask
    row_mask = _metric_weights(ops.cast(mask, "float32"), y_pred)
    for metric in loop.metrics:
        yield metric, (y_true, y_pred), row_mask
    if loop.weighted_metrics:
        _check_metric_weights(static_shape(weights), y_pred)
        weighted = ops.cast(weights, "float32")
        if len(weighted.shape) > 1:
            weighted = weighted * to_rank(ops.cast(mask, "float32"), len(weighted.shape))
        else:
            weighted = weighted * ops.cast(mask, "float32")
        weighted = _metric_weights(weighted, y_pred)
        for metric in loop.weighted_metrics:
            yield metric, (y_true, y_pred), weighted


def update_metrics(loop, y_true, y_pred, per_example, weights, mask, update=None) -> None:
    """Update the loop's metric variables in place with one batch (TensorFlow and torch;
    JAX's step updates its explicit state with `metric_updates` itself). Each replica or
    process updates with its own rows; reading the results sums them across.

    `update(metric, y_true, y_pred, sample_weight)`, where given, updates each of the
    compiled or given metrics instead of its `update_state` (torch gathers the global
    batch's rows for users' metrics there); the loss tracker, a Keras `Mean`, is updated
    directly."""
    for metric, args, sample_weight in metric_updates(
        loop, y_true, y_pred, per_example, weights, mask
    ):
        if update is None or metric is loop.loss_tracker:
            metric.update_state(*args, sample_weight=sample_weight)
        else:
            update(metric, *args, sample_weight)


def _check_metric_weights(weights_shape: tuple, y_pred) -> None:
    """Raise where the weighted metrics' weights cannot weigh any metric of this
    prediction: a metric has at most one value per prediction element (most reduce its last
    axis: one per row and step of a `(rows, steps, classes)` prediction)."""
    shape = static_shape(keras.tree.flatten(y_pred)[0])
    if fits(weights_shape, shape):
        return
    raise ValueError(
        f"The weighted metrics' weights have shape {weights_shape} and the prediction has "
        f"shape {shape}: a metric has at most one value per prediction element, and most "
        f"(accuracy, the losses as metrics) one per row, or per row and step, the "
        "prediction's last axis reduced. Weights per step, (rows, steps), need a prediction "
        "per step, (rows, steps, classes); a prediction with one value per row takes weights "
        "of shape (rows,) or (rows, 1)."
    )


def _metric_weights(weights, y_pred):
    """A row's weight, `(rows,)`, shaped for a metric of this prediction: one value per row
    and step (the prediction's last axis reduced), as Keras's metrics compute them; per-step
    weights as they are; and as the Keras mask where the prediction has one (Keras folds
    the mask into the weights in place, which torch cannot broadcast)."""
    from keras import ops

    leaf = keras.tree.flatten(y_pred)[0]
    rank = max(1, len(leaf.shape) - 1)
    if len(weights.shape) < rank:
        weights = ops.reshape(weights, (-1,) + (1,) * (rank - 1))
    step_mask = keras_internals.keras_mask(leaf)
    if step_mask is not None and len(step_mask.shape) == len(weights.shape):
        weights = weights * ops.ones_like(step_mask, dtype=weights.dtype)
    return weights
