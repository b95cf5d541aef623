"""Static-size batches over a user's batched `tf.data.Dataset` (imported only for such inputs)."""

from __future__ import annotations

import tensorflow as tf

from keras_accel.data.batching import BatchPlan, static_batch_size


def _standardize(element):
    if isinstance(element, tuple):
        if not 1 <= len(element) <= 3:
            raise ValueError(
                "A tf.data element must be x, (x,), (x, y) or (x, y, sample_weight). "
                f"Received a tuple of {len(element)} elements."
            )
        return element + (None,) * (3 - len(element))
    return element, None, None


def _rows(x):
    return tf.shape(tf.nest.flatten(x)[0])[0]


class StaticTFBatches:
    """A user's batched tf.data pipeline, each batch padded to one static size in the graph.

    Weighting evaluation exactly needs the total row count, and predicting needs each batch's
    row count, so construction makes one counting pass over the pipeline.
    """

    def __init__(
        self, dataset: tf.data.Dataset, *, num_replicas: int, remainder: str, training: bool
    ):
        sizes = [int(n) for n in dataset.map(lambda *e: _rows(_standardize(e)[0]))]
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
        self.sizes = sizes
        self.plan = BatchPlan(
            num_samples=sum(sizes),
            batch_size=first,
            static_rows=static_batch_size(first, num_replicas),
            remainder=remainder,
            training=training,
        )
        drop = remainder == "drop" and sizes[-1] < first and len(sizes) > 1
        if drop:
            self.sizes = sizes[:-1]
            dataset = dataset.take(len(sizes) - 1)
        static = self.plan.static_rows
        plan = self.plan
        uniform = plan.weight_scale(first) if not training else None

        def pad(*element):
            x, y, sample_weight = _standardize(element)
            rows = _rows(x)
            missing = static - rows

            def pad_leaf(t):
                t = tf.convert_to_tensor(t)
                padded = tf.pad(t, [[0, missing]] + [[0, 0]] * (t.shape.rank - 1))
                return tf.ensure_shape(padded, [static] + t.shape[1:].as_list())

            if y is None:
                return (tf.nest.map_structure(pad_leaf, x),)
            weights = (
                tf.ones([rows], tf.float32)
                if sample_weight is None
                else tf.cast(sample_weight, tf.float32)
            )
            scale = (
                tf.cast(static, tf.float32) / tf.cast(rows, tf.float32)
                if uniform is None
                else tf.constant(uniform, tf.float32)
            )
            return (
                tf.nest.map_structure(pad_leaf, x),
                tf.nest.map_structure(pad_leaf, y),
                pad_leaf(weights * scale),
            )

        # A known length lets Keras stop by count, not by an end-of-data error inside a
        # replicated step (which aborts MirroredStrategy's collectives).
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(self.sizes)))
        self.fit_input = dataset.map(pad, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE
        )

    @property
    def static_rows(self) -> int:
        return self.plan.static_rows

    @property
    def num_samples(self) -> int:
        return self.plan.num_samples

    def rows_per_batch(self) -> list[int]:
        return list(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)
