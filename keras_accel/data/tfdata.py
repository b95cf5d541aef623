"""Static-size batches as tf.data pipelines (imported only where TensorFlow is in use).

Two sources, one padding function:

- `array_pipeline`: in-memory arrays (`keras_accel.data.sources.ArrayBatches`), batched and
  shuffled in the graph, no Python in the pipeline;
- `StaticTFBatches`: a user's batched `tf.data.Dataset`.

Both hand every batch's real rows to `_padded`, which optionally runs a model's own
preprocessing first (a keras-hub task's `preprocess_samples`: raw strings in, token ids out),
then pads to the static size and weights the rows by indexing the batch plan's table
(`keras_accel.data.batching.BatchPlan.weight_scales`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_accel.data.batching import BatchPlan, pack, static_batch_size
from keras_accel.data.sources import ArrayBatches, standardize_element

Preprocess = Callable | None


def _rows(x):
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _pad_leaf(t, static: int):
    t = tf.convert_to_tensor(t)
    rows = tf.shape(t)[0]
    fill = "" if t.dtype == tf.string else tf.zeros([], t.dtype)
    padded = tf.pad(t, [[0, static - rows]] + [[0, 0]] * (t.shape.rank - 1), constant_values=fill)
    return tf.ensure_shape(padded, [static] + t.shape[1:].as_list())


def _padded(plan: BatchPlan, carry_mask: bool, preprocess: Preprocess, scaled: bool = True):
    """`fn(index, x, y, sample_weight)` -> the padded batch, as the Accelerator feeds it.

    `scaled=False` keeps the user's weights as they are (1 where none were given; 0 on
    padding): for steps that divide by the real rows themselves (`keras_accel.loop`)."""
    static = plan.static_rows
    scales = tf.constant(plan.weight_scales if scaled else np.ones_like(plan.weight_scales))

    def fn(index, x, y, sample_weight):
        if preprocess is not None:
            x, y, sample_weight = standardize_element(preprocess(x, y, sample_weight))
        pad = lambda t: _pad_leaf(t, static)  # noqa: E731
        if y is None:
            return (tf.nest.map_structure(pad, x),)
        rows = _rows(x)
        scale = tf.gather(scales, index)
        if sample_weight is None:
            weights = tf.fill([rows], scale)
        else:
            weights = tf.cast(sample_weight, tf.float32) * scale
        x, y, weights = (tf.nest.map_structure(pad, t) for t in (x, y, weights))
        if not carry_mask:
            return x, y, weights
        return pack(x, y, weights, pad(tf.ones([rows], tf.float32)))

    return fn


def take_rows(dataset, rows: slice):
    """`dataset` with only `rows` of every batch: one process's share of global batches."""

    def cut(element):
        return tf.nest.map_structure(lambda t: t[rows.start : rows.stop], element)

    def cut_items(*items):  # tf.data passes a tuple's items apart.
        return cut(items)

    fn = cut_items if isinstance(dataset.element_spec, tuple) else cut
    return dataset.map(fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def array_pipeline(
    batches: ArrayBatches,
    carry_mask: bool = True,
    preprocess: Preprocess = None,
    scaled: bool = True,
) -> tf.data.Dataset:
    """Static padded batches over in-memory arrays, computed entirely in the tf.data graph.

    No Python runs inside the pipeline. (A `numpy_function` there deadlocks: under a
    strategy Keras peeks one batch from a fresh iterator before training and drops it, and
    the iterator's destructor, run with the GIL held, waits for prefetch threads that wait
    for the GIL.) The arrays become TensorFlow tensors once, as in plain Keras; batches are
    gathered from them by index. Epoch k's row order is a stateless function of
    (seed, k), read from a variable that `Accelerator.fit` sets at each epoch's start, so a
    resumed run sees the same order.
    """
    plan = batches.plan
    n, rows = plan.num_samples, plan.batch_size
    with tf.device("/cpu:0"):
        sample_weight = batches.sample_weight
        leaves = tf.nest.map_structure(
            lambda a: None if a is None else tf.constant(a),
            (batches.x, batches.y, None if sample_weight is None else sample_weight),
        )
        epoch = tf.Variable(batches.epoch, dtype=tf.int64, trainable=False, name="epoch")
    batches.epoch_listeners.append(lambda value: epoch.assign(value))
    seed = tf.constant(batches.seed % 2**63, tf.int64)
    real_rows = tf.constant(plan.real_rows)
    pad = _padded(plan, carry_mask, preprocess, scaled)

    def load(index):
        positions = index * rows + tf.range(tf.gather(real_rows, index), dtype=tf.int64)
        if batches.shuffle:
            positions = tf.random.experimental.index_shuffle(
                positions, seed=tf.stack([seed, epoch.read_value()]), max_index=n - 1
            )
        x, y, sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else tf.gather(t, positions), leaves
        )
        return pad(index, x, y, sample_weight)

    dataset = tf.data.Dataset.range(len(batches)).map(
        load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    options = tf.data.Options()
    # Batches come from in-memory rows, not files: shard by data across workers.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


class StaticTFBatches:
    """A user's batched tf.data pipeline, each batch padded to one static size in the graph.

    Weighting evaluation exactly needs the total row count, and predicting needs each batch's
    row count, so construction makes one counting pass over the pipeline.
    """

    def __init__(
        self, dataset: tf.data.Dataset, *, num_replicas: int, remainder: str, training: bool
    ):
        spec = dataset.element_spec
        self.has_targets = isinstance(spec, tuple) and len(spec) >= 2
        self.weighted = isinstance(spec, tuple) and len(spec) == 3
        sizes = [int(n) for n in dataset.map(lambda *e: _rows(_element(e)[0]))]
        if not sizes:
            raise ValueError("The tf.data.Dataset is empty: it yielded no batch.")
        first = sizes[0]
        odd = [i for i, n in enumerate(sizes[:-1]) if n != first]
        if odd:
            raise ValueError(
                f"Batch {odd[0]} of the tf.data.Dataset has {sizes[odd[0]]} rows but the first "
                f"has {first}. keras_accel pads only the last batch: batch the data set with "
                "one batch size (`dataset.batch(n)`)."
            )
        self.source = dataset
        self.plan = BatchPlan(
            num_samples=sum(sizes),
            batch_size=first,
            static_rows=static_batch_size(first, num_replicas),
            remainder=remainder,
            training=training,
        )

    def pipeline(self, carry_mask: bool = True, preprocess: Preprocess = None, scaled=True):
        pad = _padded(self.plan, carry_mask, preprocess, scaled)
        # A known length lets Keras stop by count, not by an end-of-data error inside a
        # replicated step (which aborts MirroredStrategy's collectives).
        dataset = self.source.take(self.plan.num_batches).apply(
            tf.data.experimental.assert_cardinality(self.plan.num_batches)
        )
        return (
            dataset.enumerate()
            .map(
                lambda index, *e: pad(index, *_element(e)),
                num_parallel_calls=tf.data.AUTOTUNE,
            )
            .prefetch(tf.data.AUTOTUNE)
        )

    def __len__(self) -> int:
        return self.plan.num_batches


def _element(element: tuple):
    # tf.data passes a tuple element's parts as separate arguments, anything else as one.
    return standardize_element(element[0] if len(element) == 1 else element)
