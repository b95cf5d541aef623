"""Global-batch losses on tf.distribute: every replica's loss is that of its own rows, and
the optimizer averages the replicas' gradients (`install_global_batch_losses`)."""

from __future__ import annotations

import contextvars

import keras
import tensorflow as tf

from keras_accel.adapter.backends.tensorflow.shared import ours, share
from keras_accel.adapter.patches import Patches
from keras_accel.utils import keras_internals

_REDUCED: contextvars.ContextVar = contextvars.ContextVar("keras_accel_reduced", default=False)


def install_global_batch_losses(patches: Patches, strategy) -> None:
    """Make every replica's loss the loss of its own rows, as on JAX and on one device, and
    average the gradients across replicas, under `strategy`, for the duration of `patches`.

    Keras on `tf.distribute` divides each replica's loss by the replica count (so that the
    gradients its optimizer sums across replicas add up to the global batch's), and divides
    it back only for the loss tracker of its built-in steps. A custom `train_step` that
    reports `compute_loss` as in Keras's guides therefore shows the loss divided by the
    replica count, on TF only. Here losses are not divided, and the optimizer averages the
    replicas' gradients instead of summing them: the same updates, and the same numbers on
    both backends for built-in and custom steps. The average is taken before gradient
    clipping and accumulation, so that `clipnorm` and `global_clipnorm` act on the global
    batch's gradient, as on JAX and on one device.
    """
    share(patches, strategy, "global_batch_losses", _install_global_batch_losses)


def _install_global_batch_losses(patches: Patches) -> None:
    losses = keras_internals.loss_module()

    def unscaled(original):
        def scale(value):
            return value if ours() else original(value)

        return scale

    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        patches.set(losses, name, unscaled(getattr(losses, name)))
    optimizer_class = keras_internals.tf_optimizer_class()

    def averaging(original_apply):
        def apply(self, grads, trainable_variables=None):
            context = tf.distribute.get_replica_context()
            if context is None or context.num_replicas_in_sync == 1 or _REDUCED.get() or not ours():
                return original_apply(self, grads, trainable_variables)
            grads = list(grads)
            present = [i for i, g in enumerate(grads) if g is not None]
            reduced = context.all_reduce(tf.distribute.ReduceOp.MEAN, [grads[i] for i in present])
            for i, g in zip(present, reduced):
                grads[i] = g
            token = _REDUCED.set(True)
            try:
                return original_apply(self, grads, trainable_variables)
            finally:
                _REDUCED.reset(token)

        return apply

    def all_reduce_gradients(self, grads_and_vars):
        if not ours():
            return original_all_reduce(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        if _REDUCED.get():
            return grads_and_vars  # Averaged in `apply` already.
        context = tf.distribute.get_replica_context()
        if context is None:
            return grads_and_vars
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        reduced = context.all_reduce(
            tf.distribute.ReduceOp.MEAN, [grads_and_vars[i][0] for i in present]
        )
        for i, g in zip(present, reduced):
            grads_and_vars[i] = (g, grads_and_vars[i][1])
        return grads_and_vars

    patches.set(optimizer_class, "apply", averaging(optimizer_class.apply))
    # LossScaleOptimizer (float16) has an apply of its own, which checks the gradients for
    # overflow before its inner optimizer's: it must see the averaged ones too, so that every
    # replica takes the same decision (and no all-reduce runs inside its cond).
    loss_scale = keras.optimizers.LossScaleOptimizer
    patches.set(loss_scale, "apply", averaging(loss_scale.apply))
    # Keras's own, which the replacement calls outside our strategies (read as it goes in).
    original_all_reduce = keras_internals.replace_all_reduce_sum_gradients(
        patches, optimizer_class, all_reduce_gradients
    )
