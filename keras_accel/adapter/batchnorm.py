"""BatchNormalization statistics over real rows only, identical on every replica.

Two problems, one fix:

- padding rows (see `keras_accel.data.batching`) must not enter the batch mean and variance,
  or a padded batch would train differently from its real rows alone;
- under `tf.distribute`, Keras's BatchNormalization computes statistics per replica, so the
  moving statistics drift apart across replicas (tensorflow#46488) and `get_weights()` returns
  one replica's copy.

While a step is traced, `keras_accel.adapter.steps` publishes the batch's row mask (sample
weight > 0) in `ROW_MASK`. Each BatchNormalization layer of a prepared model gets a `_moments`
that weights rows by that mask and, when the backend runs one program per replica (TF), sums
the three moments across replicas before dividing. Under JAX the program is global-view SPMD,
so plain sums already span every replica.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Callable

from keras import backend, layers, ops

ROW_MASK: contextvars.ContextVar = contextvars.ContextVar("keras_accel_row_mask", default=None)

_PATCHED = "_keras_accel_moments"


def _weighted_moments(layer, inputs, mask, all_reduce_sum: Callable | None):
    row_mask = ROW_MASK.get()
    axes = layer._reduction_axes
    weights = ops.ones_like(inputs[..., :1]) if row_mask is None else None
    if row_mask is not None:
        row_mask = ops.cast(row_mask, inputs.dtype)
        weights = ops.reshape(row_mask, (-1,) + (1,) * (len(inputs.shape) - 1))
    if mask is not None:
        weights = weights * ops.expand_dims(ops.cast(mask, inputs.dtype), -1)
    weights = ops.broadcast_to(weights, ops.shape(inputs))
    total = ops.sum(weights * inputs, axes, keepdims=True)
    squares = ops.sum(weights * ops.square(inputs), axes, keepdims=True)
    count = ops.sum(weights, axes, keepdims=True)
    if all_reduce_sum is not None:
        total, squares, count = all_reduce_sum([total, squares, count])
    count = ops.maximum(count, backend.epsilon())
    mean = total / count
    # E[x^2] - E[x]^2 is what makes the three sums reducible across replicas in one pass.
    variance = ops.maximum(squares / count - ops.square(mean), 0.0)
    return ops.reshape(mean, (-1,)), ops.reshape(variance, (-1,))


def patch_batchnorm(model, all_reduce_sum: Callable | None = None) -> int:
    """Give every BatchNormalization layer of `model` masked (and synchronized) moments.

    Args:
        model: a Keras model; nested models are covered.
        all_reduce_sum: sums a list of per-replica tensors across replicas, or None where the
            program already sees the global batch.

    Returns:
        The number of layers patched (idempotent: a second call patches none).
    """
    count = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not isinstance(layer, layers.BatchNormalization) or getattr(layer, _PATCHED, False):
            continue
        if layer.renorm:
            # Renorm's corrections are not defined for weighted rows; keep Keras's own path.
            continue
        original = layer._moments

        def moments(self, inputs, mask, _original=original):
            if ROW_MASK.get() is None and all_reduce_sum is None:
                return _original(inputs, mask)
            return _weighted_moments(self, inputs, mask, all_reduce_sum)

        object.__setattr__(layer, "_moments", types.MethodType(moments, layer))
        object.__setattr__(layer, _PATCHED, True)
        count += 1
    return count
