"""BatchNormalization statistics over real rows only, identical on every replica.

Two problems, one fix:

- padding rows (see `keras_accel.data.batching`) must not enter the batch mean and variance,
  or a padded batch would train differently from its real rows alone;
- under `tf.distribute`, Keras's BatchNormalization computes statistics per replica (unless
  `synchronized=True`), so the moving statistics drift apart across replicas
  (tensorflow#46488) and `get_weights()` returns one replica's copy.

While a step is traced, `keras_accel.adapter.steps` publishes the batch's row mask in
`ROW_MASK`. For the duration of an Accelerator call, each BatchNormalization layer gets a
`_moments` that weights rows by that mask and computes the moments one device computes: the
mean over every real row, then the mean of the squared deviations from it. Where the backend
runs one program per replica (TF's strategies, torch's processes) each is a sum across
replicas before dividing: the row count and the sum of the rows, then, once the mean is
known, the sum of squared deviations. Under JAX the program is global-view SPMD, so plain
sums already span every replica (Keras's `synchronized` is a no-op there too). Layers built
with `renorm=True` get them too: Keras computes their corrections (r, d) and renorm
statistics from these batch moments alone. When the call returns the layers get Keras's own
`_moments` back.

Why two passes: Keras's one-device moments on JAX (`jnp.var`) and TensorFlow
(`tf.nn.moments`), and its masked `_moments` on every backend, take the mean of squared
deviations; E[x^2] - E[x]^2, which one pass over the replicas' sums would give (and which
Keras's own `synchronized=True` computes), loses the variance to rounding when the mean is
large beside the spread. torch's `ops.moments` is E[x^2] - E[x]^2 itself: there one process
of plain Keras carries that rounding, which no other summation order reproduces; the two
passes give what one process and several agree on (tests/adapter/test_torch.py).

What the synchronization costs (`Accelerator(sync_batchnorm=...)`): on TF each layer's sums
cross the replicas twice forward (the mean's, then the squared deviations') and twice more
backward (the gradient of an all-reduce is an all-reduce), in sequence, since each waits for
the one before. With TensorFlow's default collectives those sums were the whole difference
between `acc.fit` and plain `model.fit` on 8 CPU replicas (about 1 ms per all-reduce); the
Accelerator's strategy sums through one device there
(`keras_accel.adapter.backends.tensorflow.strategies.cross_device_ops`, 0.06 ms), and the
default is within 8% of plain Keras (docs/benchmarks.md, measured with one pass). With
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
    count = ops.sum(weights, axes, keepdims=True)
    if all_reduce_sum is not None:
        total, count = all_reduce_sum([total, count])
    count = ops.maximum(count, backend.epsilon())
    mean = total / count
    # The mean of squared deviations from the global mean (see the module's docstring): it
    # needs that mean first, so a second sum across replicas.
    deviations = inputs - _held(mean)
    squares = ops.sum(weights * ops.square(deviations), axes, keepdims=True)
    if all_reduce_sum is not None:
        (squares,) = all_reduce_sum([squares])
    variance = squares / count
    return ops.reshape(mean, (-1,)), ops.reshape(variance, (-1,))


def _held(mean):
    """The mean as the variance sees it: TensorFlow's `tf.nn.moments` stops its gradient
    there (`squared_difference(x, stop_gradient(mean))`); JAX's `jnp.var` and Keras's masked
    `_moments` let it flow. Either way that gradient is zero up to rounding (the deviations
    sum to zero); only the rounding follows the backend's one device."""
    return ops.stop_gradient(mean) if backend.backend() == "tensorflow" else mean


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
