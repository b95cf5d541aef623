"""BatchNormalization statistics over real rows only, identical on every replica.

Two problems, one fix:

- padding rows (see `keras_accel.data.batching`) must not enter the batch mean and variance,
  or a padded batch would train differently from its real rows alone;
- under `tf.distribute`, Keras's BatchNormalization computes statistics per replica (unless
  `synchronized=True`), so the moving statistics drift apart across replicas
  (tensorflow#46488) and `get_weights()` returns one replica's copy.

While a step is traced, `keras_accel.adapter.steps` publishes the batch's row mask in
`ROW_MASK`. For the duration of an Accelerator call, each BatchNormalization layer gets a
`_moments` that weights rows by that mask and, when the backend runs one program per replica
(TF), sums the three moments across replicas before dividing: exactly Keras's
`synchronized=True` statistics, over real rows. Under JAX the program is global-view SPMD, so
plain sums already span every replica (Keras's `synchronized` is a no-op there too). Layers
built with `renorm=True` get them too: Keras computes their corrections (r, d) and renorm
statistics from these batch moments alone. When the call returns the layers get Keras's own
`_moments` back.

What the synchronization costs (`Accelerator(sync_batchnorm=...)`): on TF each layer's sums
cross the replicas once forward and once more backward (the gradient of an all-reduce is an
all-reduce), in sequence, since each layer waits for the one before. With TensorFlow's
default collectives that was the whole difference between `acc.fit` and plain `model.fit`
on 8 CPU replicas (about 1 ms per all-reduce); the Accelerator's strategy sums through one
device there (`keras_accel.adapter.backends.tensorflow.strategies.cross_device_ops`, 0.06
ms), and the default is within 8% of plain Keras (docs/benchmarks.md). With
`sync_batchnorm=False` each replica keeps its own masked moments, as plain Keras does,
except for layers built with `synchronized=True`, which still synchronize.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from keras import backend, layers, ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import ROW_MASK
from keras_accel.utils import keras_internals


def _weighted_moments(layer, inputs, mask, all_reduce_sum: Callable | None):
    row_mask = ROW_MASK.get()
    # A tuple: Keras keeps a tracked list, which torch.compile cannot pass to torch.sum.
    axes = tuple(keras_internals.batchnorm_reduction_axes(layer))
    if row_mask is None:
        weights = ops.ones_like(inputs[..., :1])
    else:
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


def install_batchnorm(
    patches: Patches,
    model,
    all_reduce_sum: Callable | None = None,
    synchronized: bool = True,
) -> int:
    """Give every BatchNormalization layer of `model` masked (and synchronized) moments for
    the duration of `patches`.

    Args:
        model: a Keras model; nested models are covered.
        all_reduce_sum: sums a list of per-replica tensors across replicas, or None where the
            program already sees the global batch.
        synchronized: sum every layer's moments across replicas (True), or only those of
            layers built with `synchronized=True`, Keras's own rule (False).

    Returns:
        The number of layers given our moments.
    """
    count = 0
    for layer in keras_internals.flatten_layers(model, include_self=False):
        if not isinstance(layer, layers.BatchNormalization):
            continue
        original = keras_internals.batchnorm_moments(layer)
        reduce = all_reduce_sum if synchronized or getattr(layer, "synchronized", False) else None

        def moments(self, inputs, mask, _original=original, _reduce=reduce):
            if ROW_MASK.get() is None and _reduce is None:
                return _original(inputs, mask)
            return _weighted_moments(self, inputs, mask, _reduce)

        keras_internals.replace_batchnorm_moments(patches, layer, types.MethodType(moments, layer))
        count += 1
    return count
