"""Static-size batches as tf.data pipelines (imported only where TensorFlow is in use).

Two sources, one padding function:

- `array_pipeline`: in-memory arrays (`keras_accel.data.sources.ArrayBatches`), batched and
  shuffled in the graph, no Python in the pipeline;
- `TFDatasetBatches`: a user's batched `tf.data.Dataset`, streamed (never counted first).

Both hand every batch's real rows to `_padded`, which optionally runs a model's own
preprocessing first (a keras-hub task's `preprocess_samples`: raw strings in, token ids out),
then pads to the static size and adds the row mask (see `keras_accel.data.batching`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_accel.data.batching import StreamPlan, pack, padding_like, static_batch_size
from keras_accel.data.sources import ArrayBatches, standardize_element
from keras_accel.utils import library_internals
from keras_accel.utils.printing import print_msg

Preprocess = Callable | None


def _rows(x):
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _bucket(rows, static: int):
    """`keras_accel.data.batching.bucket_rows` in the graph: `static`, doubled until it
    holds `rows` (integers only: a float log2 of an exact power may round up)."""
    static = tf.constant(static, tf.int32)
    rows = tf.cast(rows, tf.int32)
    return tf.while_loop(lambda size: size < rows, lambda size: size * 2, [static])[0]


def _pad_leaf(t, static: int, target=None):
    """`t` padded to `static` rows; to `target` (a bucket, a tensor) where the stream's
    batches may outgrow the first, its batch dimension then unknown to tf.data."""
    t = tf.convert_to_tensor(t)
    rows = tf.shape(t)[0]
    fill = "" if t.dtype == tf.string else tf.zeros([], t.dtype)
    if target is None:
        # The pad must wait for the check, else its negative padding may fail first, with
        # TensorFlow's "Paddings must be non-negative" (automatic control dependencies order
        # the stateful ops among themselves, not the pure ops after them).
        check = tf.debugging.assert_less_equal(
            rows,
            static,
            message=(
                f"keras_accel: a batch has more rows than the pipeline's batch size ({static} "
                "rows, rounded up to a replica multiple), which its `batch` step fixes: the "
                "step is compiled for that size. Batch the data set with one batch size "
                "(`dataset.batch(n)`) as its last step"
            ),
        )
        with tf.control_dependencies([check]):
            rows = tf.identity(rows)
        target, first = static, static
    else:
        first = None  # Any bucket: tf.data's element spec leaves the rows unknown.
    if t.shape.rank is None:  # E.g. `tf.io.parse_tensor`'s output: the rank is known later.
        zeros = tf.zeros([tf.rank(t) - 1, 2], tf.int32)
        paddings = tf.concat([[[0, target - tf.cast(rows, tf.int32)]], zeros], axis=0)
        return tf.pad(t, paddings, constant_values=fill)
    padded = tf.pad(t, [[0, target - rows]] + [[0, 0]] * (t.shape.rank - 1), constant_values=fill)
    return tf.ensure_shape(padded, [first] + t.shape[1:].as_list())


def _padded(
    static: int, carry_mask: bool, preprocess: Preprocess, scales=None, grows: bool = False
):
    """`fn(index, x, y, sample_weight)` -> the padded batch, as the Accelerator feeds it.

    With `carry_mask` (the Accelerator's own steps, `keras_accel.loop`) a batch carries the
    user's weights as they are (1 where none were given; 0 on padding) and the row mask: the
    step weights it. Without (`Accelerator.dataset`, for a plain `model.fit`) the weights are
    scaled here: by the batch plan's table `scales` where the data set's rows are known,
    else by the batch's own `static / real rows`. `grows`: a batch larger than `static`
    is padded to its bucket (`_bucket`) instead of refused."""
    table = None if scales is None else tf.constant(scales, tf.float32)

    def fn(index, x, y, sample_weight):
        if preprocess is not None:
            x, y, sample_weight = standardize_element(preprocess(x, y, sample_weight))
        rows = _rows(x)
        target = _bucket(rows, static) if grows else None
        pad = lambda t: _pad_leaf(t, static, target)  # noqa: E731
        if y is None:
            if not carry_mask:
                return (tf.nest.map_structure(pad, x),)
            return pack(tf.nest.map_structure(pad, x), None, None, pad(tf.ones([rows])))
        if sample_weight is None:
            weights = tf.ones([rows], tf.float32)
        else:
            weights = tf.cast(sample_weight, tf.float32)
        if not carry_mask:
            if table is not None:
                scale = tf.gather(table, index)
            else:
                size = static if target is None else target
                scale = tf.cast(size, tf.float32) / tf.cast(rows, tf.float32)
            weights = weights * scale
        x, y, weights = (tf.nest.map_structure(pad, t) for t in (x, y, weights))
        if not carry_mask:
            return x, y, weights
        return pack(x, y, weights, pad(tf.ones([rows], tf.float32)))

    return fn


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
        size = None if static is None else _rows(element)
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
    leaves, order, real_rows = _array_sources(batches)
    if preprocess is None:
        # Several batches per map call, cut apart by `unbatch` (the same batches).
        group = _group_size(leaves, plan.static_rows, len(batches))
        load = _group_loader(batches, leaves, real_rows, order, carry_mask)
        dataset = (
            tf.data.Dataset.range(len(batches))
            .batch(group)
            .map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .unbatch()
            # `unbatch` forgets the length, which Keras reads as the epoch's steps.
            .apply(tf.data.experimental.assert_cardinality(len(batches)))
        )
    else:
        pad = _padded(plan.static_rows, carry_mask, preprocess, plan.weight_scales)

        def load(index):
            positions = index * rows + tf.range(tf.gather(real_rows, index), dtype=tf.int64)
            if order is not None:
                positions = tf.gather(order, positions)
            x, y, sample_weight = tf.nest.map_structure(
                lambda t: None if t is None else tf.gather(t, positions), leaves
            )
            return pad(index, x, y, sample_weight)

        dataset = tf.data.Dataset.range(len(batches)).map(
            load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )
    return _with_array_options(dataset)


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
    batch size, flattened), the rows past each slot's `real` rows zeros with mask and weight
    0, the weights the user's (as float32) or the mask: the batches `ArrayBatches.batch`
    makes, value for value."""
    static = positions.shape[0] // steps
    mask = tf.cast(tf.range(static)[tf.newaxis, :] < real[:, tf.newaxis], tf.float32)

    def gathered(t, dtype=None):
        out = tf.gather(t, positions)
        out = tf.reshape(out, [steps, static, *t.shape[1:]])
        if dtype is not None:
            out = tf.cast(out, dtype)
        keep = tf.reshape(mask > 0, [steps, static] + [1] * (out.shape.rank - 2))
        return tf.where(keep, out, tf.zeros_like(out))

    x, y, sample_weight = leaves
    x = tf.nest.map_structure(gathered, x)
    if y is None:
        return pack(x, None, None, mask)
    y = tf.nest.map_structure(gathered, y)
    weights = mask if sample_weight is None else gathered(sample_weight, tf.float32)
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
    the batch `_padded` makes from that batch's rows alone (the same rows, order, padding,
    weights and mask), gathered in one op per array for the whole group. The rows are in
    the epoch's `order` (a variable; None: unshuffled)."""
    plan = batches.plan
    rows, static = plan.batch_size, plan.static_rows
    scales = tf.constant(plan.weight_scales, tf.float32)

    def load(indices):
        count = tf.shape(indices)[0]
        offsets = tf.range(static, dtype=tf.int64)
        # Row r of batch i is real where r < its real rows (never past `rows` <= `static`).
        real = offsets[tf.newaxis, :] < tf.gather(real_rows, indices)[:, tf.newaxis]
        positions = tf.where(real, indices[:, tf.newaxis] * rows + offsets[tf.newaxis, :], 0)
        positions = tf.reshape(positions, [-1])
        if order is not None:
            positions = tf.gather(order, positions)

        def grouped(t):
            return tf.reshape(t, tf.concat([[count, static], tf.shape(t)[1:]], axis=0))

        def masked(t):
            # Padding rows hold zeros ("" for strings), as `_pad_leaf` pads.
            keep = tf.reshape(real, [-1, static] + [1] * (t.shape.rank - 2))
            return tf.where(keep, t, tf.zeros_like(t))

        def gathered(t):
            out = masked(grouped(tf.gather(t, positions)))
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


class TFDatasetBatches:
    """A user's batched tf.data pipeline, streamed: each batch padded to one static size in
    the graph as it comes, never counted first.

    The batch size is read from the pipeline's graph (the `batch` transformation, as Keras's
    own multi-process sharding reads it), else from its first batch. The length is the
    pipeline's cardinality where tf.data knows it (finite, infinite, or unknown: then an
    epoch ends where the data ends, or at `steps_per_epoch`). A short batch is recognised
    where it arrives and padded; its real rows travel with it as the row mask, which is all
    the step needs to weight it exactly. Where the batch size comes from the first batch
    only (`grows`), a larger batch is padded to a bucket (`_bucket`).
    """

    own_files = None  # This process's own files (`ProcessFiles`), where several share them.

    def __init__(
        self,
        dataset: tf.data.Dataset,
        *,
        num_replicas: int,
        remainder: str,
        training: bool,
        class_weight: dict | None = None,
    ):
        reason = unbatched(dataset)
        if reason is not None:
            raise ValueError(
                f"The tf.data.Dataset is not batched: {reason}. As in Keras, a tf.data."
                "Dataset passed to fit, evaluate or predict yields batches: pass "
                "dataset.batch(batch_size) (e.g. dataset.batch(32)), without batch_size."
            )
        if class_weight is not None:
            dataset = class_weighted(dataset, class_weight)
        spec = dataset.element_spec
        self.has_targets = isinstance(spec, tuple) and len(spec) >= 2
        self.weighted = isinstance(spec, tuple) and len(spec) == 3
        self.source = dataset
        fixed = _fixed_batch_size(spec)
        known = fixed or _graph_batch_size(dataset)
        rows = known or self._first_rows()
        static = static_batch_size(rows, num_replicas)
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise ValueError("The tf.data.Dataset is empty: its cardinality is 0.")
        self.remainder = "pad" if fixed else remainder
        # Where neither the element spec nor a `batch` step says the batch size (a
        # generator's batches, `from_generator`), a later batch may be larger than the
        # first: it is padded to a bucket (`keras_accel.data.batching.bucket_rows`), as
        # plain Keras takes any size. The batch dimension tf.data reports is then unknown.
        self.grows = known is None
        self.plan = StreamPlan(
            batch_size=rows,
            static_rows=static,
            num_batches=cardinality if cardinality > 0 and self.remainder == "pad" else None,
            infinite=cardinality == tf.data.INFINITE_CARDINALITY,
            pads=not (fixed and static == fixed),
            remainder=self.remainder,
            training=training,
            kind="tf.data.Dataset",
        )

    def _first_rows(self) -> int:
        # One batch read before training, where the graph does not say the batch size.
        for element in self.source.take(1):
            return int(_rows(_element(element if isinstance(element, tuple) else (element,))[0]))
        raise ValueError("The tf.data.Dataset is empty: it yielded no batch.")

    def pipeline(self, carry_mask: bool = True, preprocess: Preprocess = None):
        static = self.plan.static_rows
        pad = _padded(static, carry_mask, preprocess, grows=self.grows)
        dataset = self.source
        if self.remainder == "drop":
            full = self.plan.batch_size
            dataset = dataset.filter(lambda *e: _rows(_element(e)[0]) >= full)
        out = dataset.map(
            lambda *e: pad(None, *_element(e)), num_parallel_calls=tf.data.AUTOTUNE
        ).prefetch(tf.data.AUTOTUNE)
        if self.grows:
            out.keras_accel_static_rows = static  # What `take_rows` cuts shares of.
        return out

    def __len__(self) -> int:
        if self.plan.num_batches is None:
            raise TypeError(f"{self.plan.describe()} has no known length.")
        return self.plan.num_batches


def class_weighted(dataset: tf.data.Dataset, class_weight: dict) -> tf.data.Dataset:
    """`dataset`'s `(x, y)` batches as `(x, y, sample_weight)`, the weights from
    `class_weight` as Keras computes them (`keras_accel.data.sources.
    class_weights_to_sample_weights`: the argmax of one-hot targets, else the rounded
    target; a class the dict does not name weighs 1.0), in the graph, batch by batch."""
    from keras_accel.data.sources import check_class_weight, class_weight_table

    check_class_weight(class_weight)
    spec = dataset.element_spec
    parts = spec if isinstance(spec, tuple) else (spec,)
    if len(parts) == 3:
        raise ValueError(
            "You cannot `class_weight` and `sample_weight` at the same time. Received: "
            f"class_weight={class_weight} and a tf.data.Dataset of (x, y, sample_weight)."
        )
    if len(parts) != 2 or tf.nest.is_nested(parts[1]):
        raise ValueError(
            "`class_weight` is only supported for Models with a single output: it needs a "
            "tf.data.Dataset of (x, y) batches with one target tensor. Received: element "
            f"spec {spec}."
        )
    table = tf.constant(class_weight_table(class_weight))
    size = int(table.shape[0])

    def weigh(x, y):
        if y.shape.rank is None:
            raise ValueError(
                "`class_weight` needs targets of a known rank (class indices, or one-hot "
                f"rows). Received: y of unknown shape {y.shape}: give it one, e.g. with "
                "tf.ensure_shape in the pipeline."
            )
        if y.shape.rank >= 2 and y.shape[-1] != 1:
            if y.shape[-1] is None:
                raise ValueError(
                    "`class_weight` needs to know whether the targets are one-hot: their "
                    f"last dimension is unknown. Received: y of shape {y.shape}."
                )
            classes = tf.argmax(y, axis=-1, output_type=tf.int64)
        elif y.shape.rank >= 2:
            classes = tf.cast(tf.round(tf.squeeze(tf.cast(y, tf.float32), -1)), tf.int64)
        else:
            classes = tf.cast(tf.round(tf.cast(y, tf.float32)), tf.int64)
        inside = (classes >= 0) & (classes < size)
        weights = tf.gather(table, tf.clip_by_value(classes, 0, size - 1))
        return x, y, tf.where(inside, weights, tf.ones_like(weights))

    return dataset.map(weigh, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def _parts(spec) -> list[tuple[str, tf.TensorShape]]:
    """`(name, shape)` of every tensor of an element spec, named as Keras names the parts of
    a batch: x, y, sample_weight (x["key"] inside a dict, x[0] inside a tuple)."""
    named = []

    def visit(name, node):
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{name}[{key!r}]", value)
        elif isinstance(node, (tuple, list)):
            for i, value in enumerate(node):
                visit(f"{name}[{i}]", value)
        elif hasattr(node, "shape"):
            named.append((name, node.shape))

    for name, part in zip(("x", "y", "sample_weight"), standardize_element(spec)):
        if part is not None:
            visit(name, part)
    return named


def _shapes(spec) -> str:
    return ", ".join(f"{name} {tuple(shape)}" for name, shape in _parts(spec))


def unbatched(dataset: tf.data.Dataset) -> str | None:
    """Why `dataset`'s elements cannot be batches, or None: a part without a first (rows)
    dimension, or parts whose first dimensions differ (a batch's parts share their rows).
    An unbatched data set of examples with a label or a vector of another length is told
    here; one whose examples only look like batches is `maybe_unbatched`."""
    parts = [
        (name, shape) for name, shape in _parts(dataset.element_spec) if shape.rank is not None
    ]
    scalars = [name for name, shape in parts if shape.rank == 0]
    if scalars:
        return (
            f"its elements are single examples ({_shapes(dataset.element_spec)}): "
            f"{scalars[0]} has no first dimension of rows"
        )
    firsts = {name: shape[0] for name, shape in parts if shape[0] is not None}
    if len(set(firsts.values())) > 1:
        shown = ", ".join(f"{name} {rows}" for name, rows in firsts.items())
        return (
            f"the first dimensions of its elements' parts differ ({shown}), where a batch's "
            "parts share their rows"
        )
    return None


# Ops after which a pipeline's elements are batches (batch, padded_batch, map-and-batch,
# rebatch, dense_to_sparse_batch; bucket_by_sequence_length and windows group elements),
# and sources whose elements the user makes whole (from_tensors, from_generator).
_BATCHING = ("Batch", "GroupByWindow", "Window")
_WHOLE_SOURCES = ("TensorDataset", "GeneratorDataset")


def _graph_ops(dataset: tf.data.Dataset) -> set[str] | None:
    """The op types of the pipeline's graph, its functions' included (what `map` or
    `interleave` run); None where TensorFlow cannot serialize it."""
    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=1,  # Ignore: a stateful op is no reason to warn here.
            strip_device_assignment=True,
        )
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception:  # A pipeline TensorFlow cannot serialize: unknown.
        return None
    return {node.op for node in graph.node} | {
        node.op for function in graph.library.function for node in function.node_def
    }


def maybe_unbatched(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset`'s elements may be single examples: no step of its pipeline batches
    them (`_BATCHING`), its sources are not made whole by the user (`_WHOLE_SOURCES`), and
    every first dimension is fixed (a `batch` without drop_remainder leaves it unknown).
    Slices of arrays made of batches look the same, so this only informs an error that a
    `batch_size` given with the data set already causes: it serializes the pipeline's graph,
    in-memory arrays included, which is no cost to add to every call."""
    parts = _parts(dataset.element_spec)
    if not parts or any(shape.rank is None or shape[0] is None for _, shape in parts):
        return False
    ops = _graph_ops(dataset)
    if ops is None:
        return False
    return not any(any(word in op for word in _BATCHING) for op in ops) and not any(
        op.startswith(_WHOLE_SOURCES) for op in ops
    )


def check_arguments(dataset: tf.data.Dataset, y, batch_size, sample_weight) -> None:
    """Keras's rule for a tf.data.Dataset input: its batches hold the targets and weights,
    and it is batched by the user (`y`, `sample_weight` and `batch_size` are not passed).
    The error says what this data set needs: only to drop the argument, or to be batched."""
    for name, value, what in (
        ("y", y, "the targets"),
        ("sample_weight", sample_weight, "the sample weights"),
    ):
        if value is not None:
            raise ValueError(
                f"When providing `x` as a tf.data.Dataset, `{name}` should not be passed. "
                f"Instead, {what} should be included as part of the tf.data.Dataset: "
                f"(x, y{', sample_weight' if name == 'sample_weight' else ''}) batches."
            )
    if batch_size is None:
        return
    reason = unbatched(dataset)
    if reason is None and maybe_unbatched(dataset):
        reason = "no step of its pipeline batches its elements"
    if reason is not None:
        raise ValueError(
            "When providing `x` as a tf.data.Dataset, `batch_size` should not be passed: "
            f"the data set is batched by its pipeline. This one is not batched ({reason}): "
            f"pass dataset.batch({batch_size}) instead. Received: batch_size={batch_size}."
        )
    size = _fixed_batch_size(dataset.element_spec) or _graph_batch_size(dataset)
    batches = f"its batches, of {size} rows," if size else "its batches"
    raise ValueError(
        "When providing `x` as a tf.data.Dataset, `batch_size` should not be passed: "
        f"{batches} are the batches (dataset.rebatch(n) changes their size). Received: "
        f"batch_size={batch_size}."
    )


def _fixed_batch_size(spec) -> int | None:
    """The batch dimension where the element spec fixes it (`batch(n, drop_remainder=True)`)."""
    leaves = [leaf for leaf in tf.nest.flatten(spec) if hasattr(leaf, "shape")]
    dims = {leaf.shape[0] if leaf.shape.rank else None for leaf in leaves}
    if len(dims) == 1 and None not in dims:
        return int(dims.pop())
    return None


def _graph_batch_size(dataset) -> int | None:
    """The batch size of the pipeline's `batch` transformation, read from its graph without
    reading data (what Keras's multi-process `distribute_dataset` uses); None if unknown."""
    return library_internals.tf_compute_batch_size(dataset)  # None: read one batch instead.


# The ops tf.data's FILE auto-sharding shards by their file names (its `kReaderDatasetOps`,
# tensorflow/core/grappler/optimizers/data/auto_shard.cc), matched by prefix for their V2s.
_FILE_READERS = (
    "ArrayRecordDataset",
    "FixedLengthRecordDataset",
    "RecordIODataset",
    "SSTableDataset",
    "TextLineDataset",
    "TFRecordDataset",
)


def reads_files(dataset: tf.data.Dataset) -> bool:
    """Whether the pipeline's graph holds a file reader (TFRecord, text lines, ...), also
    inside a function (`list_files().interleave(tf.data.TFRecordDataset)`): what FILE
    sharding needs. True where the graph cannot be read (FILE sharding then decides)."""
    ops = _graph_ops(dataset)
    return ops is None or any(op.startswith(_FILE_READERS) for op in ops)


def _element(element: tuple):
    # tf.data passes a tuple element's parts as separate arguments, anything else as one.
    return standardize_element(element[0] if len(element) == 1 else element)


class ProcessFiles:
    """One process's own files of a file-backed tf.data pipeline, in its own batches.

    Where several processes train together and the pipeline reads at least as many files
    as there are processes, each process reads only its files (tf.data's FILE auto-sharding
    of the pipeline's graph, as `tf.distribute` and Keras's own multi-process
    `distribute_dataset` apply it) and batches them `batch_size / processes` rows at a time:
    its share of each global batch. Nothing is counted first. The processes' files hold
    different numbers of rows, so their data ends after different numbers of batches; where
    one process's data has ended and another's has not, the one feeds padding (row mask 0)
    until all have ended. On TensorFlow `tf.distribute`'s partial-batch handling does that
    (an empty batch for a worker that ran out, agreed per step by an all-reduce); on JAX
    `keras_accel.utils.process.EndAgreement` (`batches()`).

    A global batch is then process 0's next rows beside process 1's (and so on), not the
    pipeline's next `batch_size` rows: training sees other batches than in one process,
    while evaluation, a mean over every row, is the same.
    """

    reiterable = True

    def __init__(self, shard: tf.data.Dataset, plan: StreamPlan):
        self.shard = shard
        self.plan = plan
        self._preprocess = None
        self._firsts = {}  # By preprocessing: the raw batch (checks) or the model's (build).

    def pipeline(self, carry_mask: bool = True, preprocess: Preprocess = None):
        """This process's batches, padded to its share of the global batch (`plan`)."""
        pad = _padded(self.plan.static_rows, carry_mask, preprocess)
        dataset = self.shard
        if self.plan.remainder == "drop":
            full = self.plan.batch_size
            dataset = dataset.filter(lambda *e: _rows(_element(e)[0]) >= full)
        return dataset.map(
            lambda *e: pad(None, *_element(e)), num_parallel_calls=tf.data.AUTOTUNE
        ).prefetch(tf.data.AUTOTUNE)

    def with_preprocess(self, preprocess: Preprocess) -> ProcessFiles:
        """The same files, fed through a keras-hub task's preprocessing (`batches()`)."""
        self._preprocess = preprocess
        return self

    def first_batch(self):
        """This process's first padded batch, `(x, y, sample_weight, row_mask)` as numpy."""
        key = id(self._preprocess)
        if key not in self._firsts:
            for element in self.pipeline(True, self._preprocess).take(1):
                self._firsts[key] = _numpy_batch(element)
        return self._firsts[key]

    def batches(self, scale: bool = False):
        """One pass of this process's padded batches, then padding batches until every
        process's data has ended (JAX: `EndAgreement`)."""
        from keras_accel.utils.process import EndAgreement

        if scale:
            raise ValueError("Per-process files feed the Accelerator's own steps only.")
        ends = EndAgreement()
        step = 0
        for element in self.pipeline(True, self._preprocess).as_numpy_iterator():
            ends.have(step + 1)
            yield _numpy_batch(element)
            step += 1
        if not ends.more(step):
            return
        padding = padding_like(self.first_batch())
        while True:
            yield padding
            step += 1
            if not ends.more(step):
                return


def _numpy_batch(element):
    from keras_accel.data.batching import unpack

    x, y, sample_weight, row_mask = unpack(element)
    as_numpy = lambda t: None if t is None else np.asarray(t)  # noqa: E731
    return tuple(tf.nest.map_structure(as_numpy, t) for t in (x, y, sample_weight, row_mask))


def process_files(batches: TFDatasetBatches, num_processes: int, index: int) -> ProcessFiles | None:
    """`batches`' pipeline as this process's own files (`ProcessFiles`), or None where it
    cannot be: its batch size is not known from its graph or not a multiple of the process
    count, it reads no files, it has fewer files than processes, or this process's share
    is empty. Reads at most one of this process's batches (the FILE-sharding check, which
    tf.data makes when a pipeline is first read). Every process must agree on the answer
    before using it (the Runtimes' `agree_all`)."""
    plan = batches.plan
    policy = batches.source.options().experimental_distribute.auto_shard_policy
    if policy == tf.data.experimental.AutoShardPolicy.OFF:
        return None  # The user shards it, or wants it read whole: as it says.
    size = _graph_batch_size(batches.source)
    if size is None or size % num_processes or plan.static_rows % num_processes:
        return None
    if not reads_files(batches.source):
        # Asking tf.data's FILE sharding would answer the same, after logging an error
        # with the pipeline's graph in every process ("tf_auto_shard failed").
        return None
    try:
        auto_shard_dataset = library_internals.tf_auto_shard_dataset()
    except library_internals.LibraryInternalsError as error:
        # Reading one's own files only saves reading; every process reading the whole
        # pipeline (and keeping its rows) gives the same batches.
        _note_once(f"keras_accel: each process reads the whole pipeline ({error})")
        return None
    try:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.FILE
        )
        local = batches.source.rebatch(size // num_processes).with_options(options)
        shard = auto_shard_dataset(
            local, num_workers=num_processes, index=index, num_replicas=num_processes
        )
    except (ValueError, tf.errors.OpError):
        return None  # Not FILE-shardable here: no reader op found in the graph.
    local_plan = StreamPlan(
        batch_size=size // num_processes,
        static_rows=plan.static_rows // num_processes,
        num_batches=None,  # Each process's own count, never known in advance.
        pads=True,  # A process whose data ended feeds padding until all have ended.
        remainder=plan.remainder,
        training=plan.training,
        kind="tf.data.Dataset (this process's files)",
    )
    own = ProcessFiles(shard, local_plan)
    try:  # Padded and filtered as it will be fed: under "drop" a small share may be empty.
        first = [_numpy_batch(element) for element in own.pipeline().take(1)]
    except tf.errors.OpError:
        return None  # Not FILE-shardable here: no reader op, or fewer files than processes.
    if not first:
        return None  # An empty share.
    own._firsts[id(None)] = first[0]  # The raw first batch, read once (`first_batch`).
    return own


_NOTED: set = set()


def _note_once(message: str) -> None:
    if message not in _NOTED:
        _NOTED.add(message)
        print_msg(message)
