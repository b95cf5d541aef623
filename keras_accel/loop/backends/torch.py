"""torch: eager steps in each process, the gradients averaged over the process group.

Keras's torch backend runs a step as Python (nothing compiles), so a `StepGroup` is a
Python loop over its batches: grouping saves no host round trip here, and gives the
numbers of single steps. Several processes (`keras-accel launch`, torchrun) each feed their
rows of every global batch; the loss of each is its share of the global batch's mean over
real rows, and the optimizer applies the gradients averaged over the processes (with the
process count folded into each share, that average is the gradient of the global mean).
`results()` and `predict` meet the other processes: every process calls them.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import torch
import torch.distributed

from keras_accel.adapter.backends import global_rows
from keras_accel.adapter.backends.torch import collectives as torch_collectives
from keras_accel.adapter.backends.torch import metrics as torch_metrics
from keras_accel.adapter.backends.torch import rows as torch_rows
from keras_accel.adapter.batchnorm import install_batchnorm
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.pipeline import preprocessor
from keras_accel.adapter.steps import ROW_MASK
from keras_accel.data.batching import pack, share_rows, unpack
from keras_accel.data.sources import (
    ArrayBatches,
    IterableBatches,
    PyDatasetBatches,
    refuse_preprocessing,
)
from keras_accel.loop.batches import StepGroup
from keras_accel.loop.losses import per_example_losses
from keras_accel.loop.metrics import update_metrics


class Steps:
    def __init__(self, loop):
        self.loop = loop
        self.runtime = loop.accelerator.runtime
        self.world = self.runtime.num_replicas
        self.traces: dict[str, int] = {}
        self._gather = torch_rows.RowGather()

    # ------------------------------------------------------------------ data
    def distributed(self, batches, training: bool):
        return self.distribute(batches, training)

    def distribute(self, batches, training: bool):
        for element in self._host_batches(batches):
            yield keras.tree.map_structure(_tensor, element)

    def groups(self, batches, training: bool, n: int):
        """`StepGroup`s of up to n batches, run one after the other (eager steps)."""
        chunk = []
        for batch in self.distribute(batches, training):
            chunk.append(batch)
            if len(chunk) == n:
                yield StepGroup(chunk, n)
                chunk = []
        if chunk:
            yield StepGroup(chunk, len(chunk))

    def _host_batches(self, batches):
        """This process's rows of each batch: `pack(x, y, weights, mask)` with the user's
        weights (the step divides by the global batch's real rows itself)."""
        if preprocessor(self.loop.model) is not None:
            raise ValueError(
                "On the torch backend acc.loop feeds numbers: a keras-hub preprocessor runs "
                "in tf.data. Preprocess into arrays first, or use KERAS_BACKEND=jax or "
                "tensorflow."
            )
        own = getattr(batches, "own_files", None)
        rows = None
        if own is not None:  # This process's own files: its rows of each global batch.
            elements = own.batches()
        else:
            rows = self.runtime.process_rows(batches.plan.static_rows)
            if isinstance(batches, IterableBatches):
                refuse_preprocessing(batches, None)
                elements = batches.batches()
            elif isinstance(batches, (ArrayBatches, PyDatasetBatches)):
                elements = (batches.batch(i) for i in range(len(batches)))
            else:  # A tf.data pipeline read as numpy.
                elements = (unpack(e) for e in batches.pipeline(True, None).as_numpy_iterator())
        static = batches.plan.static_rows
        for x, y, weights, mask in elements:
            element = pack(x, y, weights, mask)
            # A batch that grew past the first is padded to a larger bucket: this process
            # takes the same fraction of it.
            mine = share_rows(rows, static, len(mask))
            if mine is not None:
                element = keras.tree.map_structure(lambda a, r=mine: np.asarray(a)[r], element)
            yield element

    # ------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def _installed(self):
        # BatchNormalization over real rows, its moments summed over the processes.
        with Patches() as patches:
            install_batchnorm(
                patches,
                self.loop.model,
                self.runtime.all_reduce_sum,
                self.loop.accelerator.sync_batchnorm,
            )
            if self.world > 1:
                # Dropout and the like draw the global batch's numbers, as one process.
                torch_rows.GlobalRowDraws(self.world, self.runtime.rank).install(
                    patches, self.loop.model
                )
            yield

    def _forward(self, x, mask, training: bool):
        token = ROW_MASK.set(mask)
        try:
            return self.loop.model(x, training=training)
        finally:
            ROW_MASK.reset(token)

    def _real_rows(self, mask):
        """The global batch's real rows (summed over the processes)."""
        total = torch.sum(mask.to(torch.float32)).reshape(1).detach().clone()
        if self.world > 1:
            torch.distributed.all_reduce(total)
        return total[0]

    def train(self, batch) -> None:
        loop = self.loop
        model = loop.model
        self.traces["train"] = self.traces.get("train", 0) + 1
        x, y, weights, mask = unpack(batch)
        real = self._real_rows(mask)
        with self._installed():
            model.zero_grad()
            y_pred = self._forward(x, mask, training=True)
            per = per_example_losses(loop.loss, y, y_pred, weights)
            # This process's share of the global mean over real rows, times the process
            # count: averaged over the processes, the gradients are the global mean's.
            value = torch.sum(per) / torch.clamp(real, min=1.0)
            scaled = loop.optimizer.scale_loss(value * self.world)
            scaled.backward()
        variables = model.trainable_variables
        grads = [v.value.grad for v in variables]
        if self.world > 1:
            grads = torch_collectives.average_gradients(grads)
        with torch.no_grad():
            loop.optimizer.apply(grads, variables)
        self._update_metrics(y, y_pred.detach() if hasattr(y_pred, "detach") else y_pred,
                             per.detach(), weights, mask)  # fmt: skip

    def test(self, batch) -> None:
        x, y, weights, mask = unpack(batch)
        with torch.no_grad(), self._installed():
            y_pred = self._forward(x, mask, training=False)
            per = per_example_losses(self.loop.loss, y, y_pred, weights)
            self._update_metrics(y, y_pred, per, weights, mask)

    def train_group(self, group) -> None:
        for batch in group.payload:
            self.train(batch)

    def test_group(self, group) -> None:
        for batch in group.payload:
            self.test(batch)

    def predict(self, batch):
        with torch.no_grad():
            return self.loop.model(unpack(batch)[0], training=False)

    def predict_masked(self, batch):
        """`(outputs, row_mask)` of one prediction batch, every process's rows in process
        order (each holds a contiguous share of the global batch)."""
        outputs, mask = self.predict(batch), unpack(batch)[3]
        if self.world > 1:
            outputs, mask = torch_collectives.gather_rows((outputs, mask))
        return outputs, mask

    def _update_metrics(self, y, y_pred, per, weights, mask):
        # Keras's own metrics: each process's own rows; `reading()` sums the states over
        # the processes. Users' metrics (any state): the global batch's rows, gathered.
        with torch.no_grad():
            update_metrics(self.loop, y, y_pred, per, weights, mask, update=self._update)

    def _update(self, metric, y, y_pred, sample_weight):
        if self.world > 1 and not global_rows.is_keras_metric(metric):
            y, y_pred, sample_weight = self._gather.rows(metric, (y, y_pred, sample_weight))
        metric.update_state(y, y_pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------ results
    @contextlib.contextmanager
    def reading(self):
        """Metric results over every process's rows while in here (a collective: every
        process reads)."""
        if self.world == 1:
            yield
            return
        metrics = self.loop.all_metrics()
        variables = [v for metric in metrics for v in metric.variables]
        # Users' metrics were updated on the global batch: global already.
        local = {id(v) for m in global_rows.user_metrics(metrics) for v in m.variables}
        values = torch_metrics.reduced_values(variables, local)
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            yield

    def sync(self) -> None:
        return None

    def metrics_reset(self) -> None:
        return None

    def to_host(self, outputs):
        return keras.tree.map_structure(keras.ops.convert_to_numpy, outputs)


def _tensor(leaf):
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
        return keras.ops.convert_to_tensor(leaf)
    return leaf
