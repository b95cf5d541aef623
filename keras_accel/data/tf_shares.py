"""Global batches of a tf.data pipeline cut into shares (imported only where TensorFlow is in
use): one process's rows of each batch (`take_rows`), and a batch as its replicas' slices
(`replica_slices`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_accel.data.tf_padding import rows_of


def take_rows(dataset, rows: slice):
    """`dataset` with only `rows` of every batch: one process's share of global batches.

    A pipeline whose batches may outgrow its first (`TFDatasetBatches.grows`) says the
    static size `rows` is a share of (`keras_accel_static_rows`): a larger batch (a bucket,
    a multiple of it) gives the same fraction of its rows."""
    static = getattr(dataset, "keras_accel_static_rows", None)

    def cut_leaf(t, size):
        if static is None:
            return t[rows.start : rows.stop]
        return t[rows.start * size // static : rows.stop * size // static]

    def cut(element):
        size = None if static is None else rows_of(element)
        return tf.nest.map_structure(lambda t: cut_leaf(t, size), element)

    def cut_items(*items):  # tf.data passes a tuple's items apart.
        return cut(items)

    fn = cut_items if isinstance(dataset.element_spec, tuple) else cut
    return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def replica_slices(dataset, parts: int):
    """Each batch of `dataset` as `parts` batches in a row, its rows cut in order: a global
    batch as its replicas' slices, which `distribute_datasets_from_function` hands to the
    replicas in turn (replica i gets rows i * n/parts onwards, as `experimental_distribute_
    dataset` would split it). The slices are views of the batch, not copies of the data
    set: no graph is serialized or cloned, so in-memory arrays are held once."""
    if parts == 1:
        return dataset

    def split(t):
        rows = t.shape[0] if t.shape.rank else None
        out = tf.reshape(t, tf.concat([[parts, -1], tf.shape(t)[1:]], axis=0))
        if t.shape.rank is not None:  # Keep every static dimension the step may read.
            out.set_shape([parts, None if rows is None else rows // parts, *t.shape[1:]])
        return out

    def cut(element):
        return tf.nest.map_structure(split, element)

    def cut_items(*items):  # tf.data passes a tuple's items apart.
        return cut(items)

    fn = cut_items if isinstance(dataset.element_spec, tuple) else cut
    return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
