"""A user's batched `tf.data.Dataset` as static-size batches, streamed (imported only where
TensorFlow is in use): `TFDatasetBatches`, each batch padded in the graph as it comes
(`keras_accel.data.tf_padding`), never counted first; `class_weighted`, its batches weighted
by class in the graph.
"""

from __future__ import annotations

import tensorflow as tf

from keras_accel.data.batching import UNPADDED, StreamPlan, static_batch_size
from keras_accel.data.class_weights import check_class_weight, class_weight_table
from keras_accel.data.tf_checks import fixed_batch_size, graph_batch_size, unbatched
from keras_accel.data.tf_padding import Preprocess, batch_padder, mapped_element, rows_of


class TFDatasetBatches:
    """A user's batched tf.data pipeline, streamed: each batch padded to one static size in
    the graph as it comes, never counted first.

    The batch size is read from the pipeline's graph (the `batch` transformation, as Keras's
    own multi-process sharding reads it), else from its first batch. The length is the
    pipeline's cardinality where tf.data knows it (finite, infinite, or unknown: then an
    epoch ends where the data ends, or at `steps_per_epoch`). A short batch is recognised
    where it arrives and padded; its real rows travel with it as the row mask, which is all
    the step needs to weight it exactly. Where the batch size comes from the first batch
    only (`grows`), a larger batch is padded to a bucket (`keras_accel.data.tf_padding`).
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
        fixed = fixed_batch_size(spec)
        known = fixed or graph_batch_size(dataset)
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
            num_batches=cardinality if cardinality > 0 and self.remainder != "drop" else None,
            infinite=cardinality == tf.data.INFINITE_CARDINALITY,
            pads=not (fixed and static == fixed) and self.remainder not in UNPADDED,
            remainder=self.remainder,
            training=training,
            kind="tf.data.Dataset",
        )

    def _first_rows(self) -> int:
        # One batch read before training, where the graph does not say the batch size.
        for element in self.source.take(1):
            return int(
                rows_of(mapped_element(element if isinstance(element, tuple) else (element,))[0])
            )
        raise ValueError("The tf.data.Dataset is empty: it yielded no batch.")

    def pipeline(self, carry_mask: bool = True, preprocess: Preprocess = None):
        static = self.plan.static_rows
        pad = batch_padder(
            static, carry_mask, preprocess, grows=self.grows, remainder=self.remainder
        )
        dataset = self.source
        if self.remainder == "drop":
            full = self.plan.batch_size
            dataset = dataset.filter(lambda *e: rows_of(mapped_element(e)[0]) >= full)
        out = dataset.map(
            lambda *e: pad(None, *mapped_element(e)), num_parallel_calls=tf.data.AUTOTUNE
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
    `class_weight` as Keras computes them (`keras_accel.data.class_weights.
    class_weights_to_sample_weights`: the argmax of one-hot targets, else the rounded
    target; a class the dict does not name weighs 1.0), in the graph, batch by batch."""
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
