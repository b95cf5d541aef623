"""In-memory arrays as static-size tf.data pipelines (imported only where TensorFlow is in use).

`array_pipeline`: the arrays of a `keras_accel.data.array_batches.ArrayBatches`, batched and
shuffled in the graph, no Python in the pipeline; `host_arrays` and `gather_group`: the same
padded batches a group at a time, for a program that gathers its own rows
(`keras_accel.data.groups.RowGroups`).

The rest of the tf.data path has a module per job; its names the backends use are imported
here too, so that `keras_accel.data.tfdata` stays the one import of the path:

- `keras_accel.data.tf_padding`: a batch padded to its static size in the graph, after a
  model's own preprocessing;
- `keras_accel.data.tf_datasets`: a user's batched `tf.data.Dataset`, streamed
  (`TFDatasetBatches`);
- `keras_accel.data.tf_checks`: what a user's pipeline is (batched or not, its batch size,
  whether it reads files) and Keras's rule for the arguments beside it (`check_arguments`);
- `keras_accel.data.tf_process_files`: one process's own files of a pipeline
  (`process_files`, `ProcessFiles`);
- `keras_accel.data.tf_shares`: a global batch cut into one process's rows (`take_rows`) and
  its replicas' slices (`replica_slices`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.batching import pack
from keras_accel.data.tf_checks import check_arguments
from keras_accel.data.tf_datasets import TFDatasetBatches
from keras_accel.data.tf_padding import Preprocess, batch_padder
from keras_accel.data.tf_process_files import ProcessFiles, process_files
from keras_accel.data.tf_shares import replica_slices, take_rows

__all__ = [
    "ProcessFiles",
    "TFDatasetBatches",
    "array_pipeline",
    "check_arguments",
    "gather_group",
    "host_arrays",
    "process_files",
    "replica_slices",
    "take_rows",
]


# TensorFlow's CPU kernels abort on a tensor whose data is not aligned to this (Eigen's
# largest alignment); numpy's large arrays usually start 16 bytes past a page.
_ALIGN = 64


def _host_tensor(a):
    """`a` as a CPU tensor holding at most one copy of its rows (none where `a` is aligned).

    `tf.constant` of a numpy array keeps two copies of it alive (measured: +1,172 MiB for a
    586 MiB array, as plain Keras's `convert_to_tensor` does); a DLPack view shares the
    numpy memory instead, after one copy into an aligned buffer where it must."""
    if not (isinstance(a, np.ndarray) and a.dtype.kind in "fiu" and a.ndim and a.size):
        return tf.constant(a)  # Strings, booleans, scalars: as before.
    if not (a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % _ALIGN == 0):
        buffer = np.empty(a.nbytes + _ALIGN, np.uint8)
        start = -buffer.ctypes.data % _ALIGN
        aligned = buffer[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        np.copyto(aligned, a)
        a = aligned
    return tf.experimental.dlpack.from_dlpack(a.__dlpack__())


def array_pipeline(
    batches: ArrayBatches,
    carry_mask: bool = True,
    preprocess: Preprocess = None,
) -> tf.data.Dataset:
    """Static padded batches over in-memory arrays, computed entirely in the tf.data graph.

    No Python runs inside the pipeline. (A `numpy_function` there deadlocks: under a
    strategy Keras peeks one batch from a fresh iterator before training and drops it, and
    the iterator's destructor, run with the GIL held, waits for prefetch threads that wait
    for the GIL.) The arrays become TensorFlow tensors once, as in plain Keras; batches are
    gathered from them by index. Epoch k's row order is `batches.epoch_indices(k)`, the
    order of every backend and of the batches one by one (a function of the seed and the
    epoch, so a resumed run sees the same order), held in a variable that is set as each
    epoch begins (`Accelerator.fit` sets `batches.epoch`).
    """
    plan = batches.plan
    rows = plan.batch_size
    total = plan.num_batches  # The whole epoch's batches.
    leaves, order, real_rows = _array_sources(batches)
    indices = tf.data.Dataset.range(total)
    first = None
    if carry_mask:
        # A fit's pipeline: an epoch begun late (a resume, `keras_accel.data.start`) reads
        # from its first batch on, in a variable that follows `batches.skipped`; the batches
        # before are not gathered. (Then the length is not known in the graph: the fit's
        # adapter says it.)
        first = _first_batch_variable(batches)
        indices = indices.filter(lambda index: index >= first.read_value())
    if preprocess is None:
        # Several batches per map call, cut apart by `unbatch` (the same batches).
        group = _group_size(leaves, plan.static_rows, total)
        load = _group_loader(batches, leaves, real_rows, order, carry_mask)
        dataset = (
            indices.batch(group)
            .map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .unbatch()
        )
        if first is None:
            # `unbatch` forgets the length, which Keras reads as the epoch's steps.
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(total))
    else:
        pad = batch_padder(plan.static_rows, carry_mask, preprocess, plan.weight_scales)

        def load(index):
            positions = index * rows + tf.range(tf.gather(real_rows, index), dtype=tf.int64)
            if order is not None:
                positions = tf.gather(order, positions)
            x, y, sample_weight = tf.nest.map_structure(
                lambda t: None if t is None else tf.gather(t, positions), leaves
            )
            return pad(index, x, y, sample_weight)

        dataset = indices.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = _with_array_options(dataset)
    if first is not None:
        dataset.keras_accel_starts_late = batches  # What `start.indexed_batches` asks.
    return dataset


def _first_batch_variable(batches: ArrayBatches) -> tf.Variable:
    """The first batch of the current epoch (0 but in an epoch begun late), as a variable
    that follows `batches.epoch`."""
    with tf.device("/cpu:0"):
        first = tf.Variable(np.int64(batches.skipped), trainable=False, name="first_batch")
    batches.epoch_listeners.append(lambda value: first.assign(np.int64(batches.skipped)))
    return first


def _array_sources(batches: ArrayBatches):
    """The arrays as host tensors (once); the row order of the current epoch as a variable
    that follows `batches.epoch` (None where the rows are not shuffled: then they are in
    order); each batch's real rows."""
    with tf.device("/cpu:0"):
        sample_weight = batches.sample_weight
        leaves = tf.nest.map_structure(
            lambda a: None if a is None else _host_tensor(a),
            (batches.x, batches.y, None if sample_weight is None else sample_weight),
        )
        order = None
        if batches.shuffle:
            first = batches.epoch_indices(batches.epoch).astype(np.int64)
            order = tf.Variable(first, trainable=False, name="row_order")
    if order is not None:
        batches.epoch_listeners.append(
            lambda value: order.assign(batches.epoch_indices(value).astype(np.int64))
        )
    return leaves, order, tf.constant(batches.plan.real_rows)


def host_arrays(batches: ArrayBatches):
    """`(x, y, sample_weight)` of `batches` as host tensors (at most one copy of each array:
    `_host_tensor`), for a program that gathers its own rows (`gather_group`)."""
    with tf.device("/cpu:0"):
        return tf.nest.map_structure(
            lambda a: None if a is None else _host_tensor(a),
            (batches.x, batches.y, batches.sample_weight),
        )


def gather_group(leaves, positions, real, steps: int):
    """The padded batches of a group (`keras_accel.data.groups.RowGroups`) as the step
    reads them, stacked on a new first axis of `steps`: `pack(x, y, weights, mask)`, each
    array's rows gathered from `leaves` (`host_arrays`) at `positions` (`steps` x the static
    batch size, flattened; a padding row's position is a real row's, `RowGroups` says which),
    the rows past each slot's `real` rows with mask and weight 0, the weights the user's (as
    float32) or the mask: the batches `ArrayBatches.batch` makes, value for value."""
    static = positions.shape[0] // steps
    mask = tf.cast(tf.range(static)[tf.newaxis, :] < real[:, tf.newaxis], tf.float32)

    def gathered(t, dtype=None):
        out = tf.gather(t, positions)
        out = tf.reshape(out, [steps, static, *t.shape[1:]])
        return out if dtype is None else tf.cast(out, dtype)

    def weighed(t):
        out = gathered(t, tf.float32)
        keep = tf.reshape(mask > 0, [steps, static] + [1] * (out.shape.rank - 2))
        return tf.where(keep, out, tf.zeros_like(out))

    x, y, sample_weight = leaves
    x = tf.nest.map_structure(gathered, x)
    if y is None:
        return pack(x, None, None, mask)
    y = tf.nest.map_structure(gathered, y)
    weights = mask if sample_weight is None else weighed(sample_weight)
    return pack(x, y, weights, mask)


def _with_array_options(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    # No auto-shard policy here: under MirroredStrategy and MultiWorkerMirroredStrategy the
    # runtime feeds each process its rows of every global batch itself (`distribute`, whose
    # per-replica data sets say OFF); a DATA set here, overridden there, made tf.data warn
    # "Changing the value of option auto_shard_policy" at every call. Where TensorFlow
    # distributes it over several hosts (a TPUStrategy), tf.data's default shards it as
    # DATA did, after finding no files.
    # As Keras's own array pipeline: tf.data's default graph rewrites, run at every
    # iterator (every epoch), serialize the whole pipeline, arrays included (measured at
    # 352 MiB: 0.7 s an iterator and a second copy at the peak, against 0.1 s without).
    options.experimental_optimization.apply_default_optimizations = False
    # No autotuning thread: deleting an iterator that a `tf.function` has read (Keras drops
    # each epoch's at the epoch's end) waits for that thread's next tuning period, measured
    # at 0.25 s in about half the epochs on TensorFlow 2.21 (a 0.4 s epoch of 1,024 small
    # steps), and nothing here needs tuning: the parallel map then uses every core, and the
    # prefetch buffer grows as the step reads (tf.data's own buffer autotuner).
    options.autotune.enabled = False
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


# Bytes of one group of batches gathered at once (`_group_size`): small enough that the
# groups in flight stay a few MiB, large enough that tf.data's per-call cost (about 0.1 ms
# a batch, measured on 2 CPU cores) falls to almost nothing for small batches.
_GROUP_BYTES = 4 * 2**20
_GROUP_LIMIT = 32


def _group_size(leaves, static_rows: int, num_batches: int) -> int:
    """Batches per gather: as many as fit in `_GROUP_BYTES`, at most `_GROUP_LIMIT`."""
    row_bytes = sum(
        t.dtype.size * int(np.prod(t.shape[1:].as_list()))
        for t in tf.nest.flatten(leaves)
        if t is not None and t.dtype != tf.string
    )
    batch_bytes = max(1, row_bytes * static_rows)
    return int(max(1, min(_GROUP_LIMIT, num_batches, _GROUP_BYTES // batch_bytes)))


def _group_loader(batches: ArrayBatches, leaves, real_rows, order, carry_mask: bool):
    """`load(indices)` -> the padded batches `indices` stacked on a new first axis: each
    the batch `batch_padder` makes from that batch's rows alone (the same rows, order, padding,
    weights and mask), gathered in one op per array for the whole group. The rows are in
    the epoch's `order` (a variable; None: unshuffled)."""
    plan = batches.plan
    rows, static = plan.batch_size, plan.static_rows
    scales = tf.constant(plan.weight_scales, tf.float32)

    def load(indices):
        count = tf.shape(indices)[0]
        offsets = tf.range(static, dtype=tf.int64)
        # Row r of batch i is real where r < its real rows (never past `rows` <= `static`).
        counts = tf.gather(real_rows, indices)[:, tf.newaxis]
        real = offsets[tf.newaxis, :] < counts
        # A padding row reads its batch's last real row, as `batch_padder` pads (its
        # `pad_rows` says why); its weight and row mask are 0 (`masked`).
        within = tf.minimum(offsets[tf.newaxis, :], tf.maximum(counts - 1, 0))
        positions = tf.reshape(indices[:, tf.newaxis] * rows + within, [-1])
        if order is not None:
            positions = tf.gather(order, positions)

        def grouped(t):
            return tf.reshape(t, tf.concat([[count, static], tf.shape(t)[1:]], axis=0))

        def masked(t):
            keep = tf.reshape(real, [-1, static] + [1] * (t.shape.rank - 2))
            return tf.where(keep, t, tf.zeros_like(t))

        def gathered(t):
            out = grouped(tf.gather(t, positions))
            return tf.ensure_shape(out, [None, static] + t.shape[1:].as_list())

        x, y, sample_weight = leaves
        x = tf.nest.map_structure(gathered, x)
        mask = tf.ensure_shape(tf.cast(real, tf.float32), [None, static])
        if y is None:
            if not carry_mask:
                return (x,)
            return pack(x, None, None, mask)
        y = tf.nest.map_structure(gathered, y)
        if sample_weight is None:
            weights = mask
        else:

            def weigh(t):
                w = tf.cast(grouped(tf.gather(t, positions)), tf.float32)
                if not carry_mask:
                    scale = tf.gather(scales, indices)
                    w = w * tf.reshape(scale, [-1] + [1] * (w.shape.rank - 1))
                return tf.ensure_shape(masked(w), [None, static] + t.shape[1:].as_list())

            weights = tf.nest.map_structure(weigh, sample_weight)
        if not carry_mask:
            if sample_weight is None:
                scale = tf.gather(scales, indices)[:, tf.newaxis]
                weights = tf.where(real, tf.ones_like(mask) * scale, 0.0)
            return x, y, weights
        return pack(x, y, weights, mask)

    return load
