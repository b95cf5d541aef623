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


def _global(original, own: bool = False):
    """`original` (a layer's call) on the global batch's shape, this replica's rows of its
    outputs kept: in training (`own` False: Keras's random layers) or at every call (`own`:
    a random layer of the user's, its inputs and outputs any structure of tensors)."""

    def call(inputs, *args, **kwargs):
        context = tf.distribute.get_replica_context()
        training = kwargs.get("training", args[0] if args else False)
        leaves = tf.nest.flatten(inputs)
        if (
            not (training or own)
            or REPLICATED.get()  # The global batch's rows already: drawn as one device.
            or context is None
            or context.num_replicas_in_sync == 1
            or not leaves
            or not all(tf.is_tensor(leaf) and leaf.shape.rank for leaf in leaves)
            or len({leaf.shape[0] for leaf in leaves}) > 1  # Not rows of one batch.
        ):
            return original(inputs, *args, **kwargs)
        world = context.num_replicas_in_sync
        replica = context.replica_id_in_sync_group
        static = tf.get_static_value(replica)  # Known under MirroredStrategy: static shapes.
        replica = int(static) if static is not None else tf.cast(replica, tf.int32)
        first = leaves[0]
        rows = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]

        def widened(t):
            rest = tf.shape(t)[1:]
            before = tf.zeros(tf.concat([[replica * rows], rest], 0), t.dtype)
            after = tf.zeros(tf.concat([[(world - replica - 1) * rows], rest], 0), t.dtype)
            return tf.concat([before, t, after], 0)

        def kept(t, like=None):
            own_rows = t[replica * rows : (replica + 1) * rows]
            if like is not None:
                own_rows.set_shape(like.shape)
            return own_rows

        outputs = original(tf.nest.map_structure(widened, inputs), *args, **kwargs)
        if tf.is_tensor(inputs) and tf.is_tensor(outputs):
            return kept(outputs, inputs)
        return tf.nest.map_structure(kept, outputs)

    return call
