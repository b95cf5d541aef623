"""The replicas' gradients summed before the optimizer clips them, per optimizer, per call.

Keras on TensorFlow divides each replica's loss by the replica count, and its optimizer sums
the replicas' gradients: the sum is the global batch's gradient. But the optimizer sums after
it clips (`clipnorm`, `clipvalue` and `global_clipnorm` then act on each replica's share),
and a `LossScaleOptimizer` (mixed float16) checks each replica's own gradients for overflow
(the replicas can then decide differently). For the duration of an Accelerator call each
optimizer the step uses sums the gradients first, in one all-reduce, then clips, checks and
applies them as Keras does: the update of one device, clipping and overflow included.

Only the optimizer instances change (two instance attributes each, undone with the call); no
Keras or TensorFlow class does, so a plain `model.fit` running beside the call, in another
thread, runs Keras's own code.
"""

from __future__ import annotations

import tensorflow as tf

from keras_accel.adapter.backends.tensorflow.reduction import reduce_undifferentiated
from keras_accel.adapter.patches import Patches
from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer


def install_summed_gradients(patches: Patches, optimizers) -> None:
    """For the duration of `patches`, each of `optimizers` sums the replicas' gradients
    before clipping them (see the module docstring)."""
    # A LossScaleOptimizer's inner optimizer is reached through the outer one's `apply`
    # only, with the sum taken: it never sums. (A flag set in `apply` could not tell it:
    # Keras's loss scaling re-enters the replicas in new threads, through a merge_call.)
    inner = {id(inner_optimizer(o)) for o in optimizers if inner_optimizer(o) is not o}
    every = {id(o): o for outer in optimizers for o in (outer, inner_optimizer(outer))}
    for optimizer in every.values():
        if id(optimizer) not in inner:
            patches.set(optimizer, "apply", _summing(optimizer.apply))
        # The sum is taken once, in `apply`; Keras's own, after clipping, would add the
        # replicas' (equal) sums again.
        keras_internals.replace_all_reduce_sum_gradients(patches, optimizer, list)


def _summing(original):
    def apply(grads, trainable_variables=None):
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return original(grads, trainable_variables)
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        # Applied, never differentiated: no gradient function (which would keep the step's
        # graphs alive for good).
        summed = reduce_undifferentiated(
            context, tf.distribute.ReduceOp.SUM, [grads[i] for i in present]
        )
        for i, g in zip(present, summed):
            grads[i] = g
        return original(grads, trainable_variables)

    return apply
