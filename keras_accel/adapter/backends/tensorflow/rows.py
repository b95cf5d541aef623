"""TensorFlow replicas: per-row random layers draw the global batch's numbers.

Under a `tf.distribute` strategy each replica runs the model on its own rows (replica r
the rows `[r * n, (r + 1) * n)` of the global batch of `P * n`), and a Dropout layer draws
its mask with the shape of its input: from the same seed, every replica would draw the mask
of the global batch's first rows, where one device draws one mask for the whole batch.
During training each such layer (`global_rows.RANDOM_ROW_LAYERS`) runs on a
global-batch-shaped input instead, this replica's rows at its offset and zeros elsewhere,
and keeps its own rows of the output: every replica draws one device's numbers. Cost: P
times that layer's elementwise work and memory (docs/accelerator.md).
"""

from __future__ import annotations

import tensorflow as tf

from keras_accel.adapter.backends.global_rows import install_row_draws
from keras_accel.adapter.steps import REPLICATED


def install_global_row_draws(patches, model) -> int:
    """Installs on every layer of `model` that `global_rows.draws`; returns how many."""
    return install_row_draws(patches, model, _global)


def _global(original):
    def call(inputs, training=False):
        context = tf.distribute.get_replica_context()
        if (
            not training
            or REPLICATED.get()  # The global batch's rows already: drawn as one device.
            or context is None
            or context.num_replicas_in_sync == 1
            or not tf.is_tensor(inputs)
        ):
            return original(inputs, training=training)
        world = context.num_replicas_in_sync
        replica = context.replica_id_in_sync_group
        static = tf.get_static_value(replica)  # Known under MirroredStrategy: static shapes.
        replica = int(static) if static is not None else tf.cast(replica, tf.int32)
        rows = inputs.shape[0] if inputs.shape[0] is not None else tf.shape(inputs)[0]
        rest = tf.shape(inputs)[1:]
        before = tf.zeros(tf.concat([[replica * rows], rest], 0), inputs.dtype)
        after = tf.zeros(tf.concat([[(world - replica - 1) * rows], rest], 0), inputs.dtype)
        outputs = original(tf.concat([before, inputs, after], 0), training=training)
        own = outputs[replica * rows : (replica + 1) * rows]
        own.set_shape(inputs.shape)
        return own

    return call
