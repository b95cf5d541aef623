"""TensorFlow: one `tf.function` per step around `strategy.run`, over a distributed tf.data."""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf

from keras_accel.adapter.backends.tensorflow import reduction
from keras_accel.adapter.backends.tensorflow.gradients import install_summed_gradients
from keras_accel.adapter.backends.tensorflow.reduction import all_reduce_sum
from keras_accel.adapter.backends.tensorflow.rows import install_global_row_draws
from keras_accel.adapter.batchnorm import install_batchnorm
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.pipeline import preprocessor
from keras_accel.adapter.steps import ROW_MASK
from keras_accel.data import tfdata
from keras_accel.data.batching import unpack
from keras_accel.data.sources import ArrayBatches, IterableBatches, PyDatasetBatches
from keras_accel.loop.batches import StepGroup
from keras_accel.loop.losses import per_example_losses
from keras_accel.loop.metrics import update_metrics


class Steps:
    def __init__(self, loop):
        self.loop = loop
        self.runtime = loop.accelerator.runtime
        self.strategy = self.runtime.native
        from keras_accel.adapter.backends.tensorflow.checks import check_gradient_accumulation

        check_gradient_accumulation(loop.optimizer, self.runtime.num_replicas)
        self.traces: collections.Counter = collections.Counter()
        self._compiled: dict[str, object] = {}
        self._pipeline = None

    # ------------------------------------------------------------------ data
    def distributed(self, batches, training: bool):
        """The distributed pipeline of `batches`, built once per batches object: its order
        follows the epoch the batches are set to, read in the graph."""
        cached = self._pipeline
        if cached is None or cached[0] is not batches:
            self._pipeline = cached = (batches, self.distribute(batches, training))
        return cached[1]

    def groups(self, batches, training: bool, n: int):
        """`StepGroup`s over one iterator of the distributed pipeline: each holds how many
        batches its fused call reads from it (n, fewer for the epoch's last group)."""
        iterator = iter(self.distributed(batches, training))
        if batches.plan.num_batches is None:
            raise ValueError(
                f"steps_per_execution={n} groups an epoch's batches, which needs its length, "
                f"but the batches are {batches.plan.describe()}. Use steps_per_execution=1 "
                "for this data, or a data set that knows its length."
            )
        total = len(batches)
        for start in range(0, total, n):
            yield StepGroup(iterator, min(n, total - start))

    def distribute(self, batches, training: bool):
        # keras-hub's preprocessing (raw strings in) runs in the pipeline, as in its fit.
        preprocess = preprocessor(self.loop.model)
        if isinstance(batches, ArrayBatches):
            dataset = tfdata.array_pipeline(batches, True, preprocess)
        elif isinstance(batches, (PyDatasetBatches, IterableBatches)):
            if preprocess is not None:
                raise ValueError(
                    "A keras-hub task's preprocessing runs over arrays or a tf.data.Dataset "
                    "of raw inputs. Received: a PyDataset. Pass the arrays, or a tf.data "
                    "pipeline."
                )
            dataset = _from_py_dataset(batches)
        elif batches.own_files is not None:  # This worker's own files (several workers).
            own = batches.own_files
            return self.runtime.distribute(own.pipeline(True, preprocess), 0, own=True)
        else:
            dataset = batches.pipeline(True, preprocess)
        if self.strategy is None:
            return dataset
        # Each worker reads its rows of each global batch, one contiguous slice per replica.
        return self.runtime.distribute(dataset, batches.plan.static_rows)

    # ------------------------------------------------------------------ steps
    def _run(self, kind: str, batch, group=None):
        loop = self.loop
        if kind == "train" and not loop.optimizer.built:
            loop.optimizer.build(loop.model.trainable_variables)
        key = kind if group is None else f"{kind}_group"
        function = self._compiled.get(key)
        if function is None:
            body = {
                "train": self._train,
                "test": self._test,
                "predict": self._predict,
                "predict_masked": self._predict_masked,
            }[kind]
            # A masked prediction is still the one predict program the user sees (as on JAX,
            # where the mask rides beside the same compiled step).
            step = self._distributed(body, kind.removesuffix("_masked"))
            function = tf.function(step if group is None else _fused(step))
            self._compiled[key] = function
        with Patches() as patches:
            # While tracing: BatchNormalization over real rows, synchronized across replicas
            # (unless `sync_batchnorm=False`);
            # the optimizer sums the replicas' gradients before clipping, as one device clips.
            install_batchnorm(
                patches,
                loop.model,
                self.runtime.all_reduce_sum,
                loop.accelerator.sync_batchnorm,
            )
            if self.runtime.num_replicas > 1:
                install_summed_gradients(patches, [self.loop.optimizer])
                # Users' metrics (any state, a running maximum) on the global batch.
                reduction.GatheredMetrics().install(patches, loop.all_metrics())
                # Dropout and the like draw one device's numbers for the global batch.
                install_global_row_draws(patches, loop.model)
            if group is not None:  # The count is a tensor: one program for every group.
                return function(group.payload, tf.constant(group.steps, tf.int32))
            return function(batch)

    def _distributed(self, body, name: str):
        strategy = self.strategy
        spans_workers = self.runtime.spans_workers

        def step(batch):
            # Python here runs once per trace (and the body once per replica within it).
            self.traces[name] += 1
            if strategy is None:
                return body(batch)
            outputs = strategy.run(body, args=(batch,))
            if outputs is None:
                return None
            # Prediction: every replica's slice, in replica order, is the global batch. As
            # in Keras's own predict, the slices are concatenated from the local results (a
            # copy), not all-gathered: no collective runs, on any replica. Several workers
            # each hold only their own replicas' rows: those are gathered, as Keras does.
            if spans_workers:
                return tf.nest.map_structure(lambda t: strategy.gather(t, axis=0), outputs)
            return tf.nest.map_structure(
                lambda t: tf.concat(strategy.experimental_local_results(t), axis=0), outputs
            )

        return step

    def train(self, batch) -> None:
        self._run("train", batch)

    def test(self, batch) -> None:
        self._run("test", batch)

    def train_group(self, group) -> None:
        self._run("train", None, group)

    def test_group(self, group) -> None:
        self._run("test", None, group)

    def predict(self, batch):
        return self._run("predict", batch)

    def _forward(self, x, mask, training: bool):
        """The model on `x`, its BatchNormalization layers reading the batch's row mask."""
        token = ROW_MASK.set(mask)
        try:
            return self.loop.model(x, training=training)
        finally:
            ROW_MASK.reset(token)

    def _train(self, batch):
        loop = self.loop
        model = loop.model
        x, y, weights, mask = unpack(batch)
        real = all_reduce_sum([tf.reduce_sum(mask)])[0]
        with tf.GradientTape() as tape:
            y_pred = self._forward(x, mask, training=True)
            per = per_example_losses(loop.loss, y, y_pred, weights)
            # This replica's share of the global batch's mean over real rows (what
            # tf.nn.compute_average_loss gives): the optimizer sums the replicas' gradients
            # (see above) into the gradient of that mean.
            value = tf.reduce_sum(per) / tf.maximum(real, 1.0)
            scaled = loop.optimizer.scale_loss(value)
        gradients = tape.gradient(scaled, model.trainable_variables)
        loop.optimizer.apply(gradients, model.trainable_variables)
        # Metric variables are summed across replicas when read: local updates suffice.
        update_metrics(loop, y, y_pred, per, weights, mask)

    def _test(self, batch):
        x, y, weights, mask = unpack(batch)
        y_pred = self._forward(x, mask, training=False)
        per = per_example_losses(self.loop.loss, y, y_pred, weights)
        update_metrics(self.loop, y, y_pred, per, weights, mask)

    def _predict(self, batch):
        return self.loop.model(unpack(batch)[0], training=False)

    def _predict_masked(self, batch):
        return self._predict(batch), unpack(batch)[3]

    def predict_masked(self, batch):
        """`(outputs, row_mask)` of one prediction batch, gathered alike (several workers
        each hold only their replicas' rows)."""
        return self._run("predict_masked", batch)

    # ------------------------------------------------------------------ results
    def sync(self) -> None:
        return None

    def metrics_reset(self) -> None:
        return None

    def to_host(self, outputs):
        return tf.nest.map_structure(lambda t: np.asarray(t), outputs)


def _fused(step):
    """`count` steps read from `iterator` in one program: the body of a `tf.while_loop`
    (not a `tf.cond` around a replicated step, which MirroredStrategy cannot run)."""

    def steps(iterator, count):
        def body(i):
            step(next(iterator))
            return (i + 1,)

        tf.while_loop(lambda i: i < count, body, (tf.constant(0),))

    return steps


def _from_py_dataset(batches) -> tf.data.Dataset:
    """The padded batches of a PyDataset or a generator as a tf.data pipeline."""
    from keras_accel.data.batching import pack

    if isinstance(batches, IterableBatches):
        elements = lambda: batches.batches()  # noqa: E731
    else:
        elements = lambda: (batches.batch(i) for i in range(len(batches)))  # noqa: E731
    first = pack(*batches.first_batch())
    signature = tf.nest.map_structure(
        lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)), first
    )

    def generate():
        for batch in elements():
            yield pack(*batch)

    return tf.data.Dataset.from_generator(generate, output_signature=signature)
