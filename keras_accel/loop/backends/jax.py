"""JAX: `jax.jit` steps over an explicit state, the batch sharded over the device mesh."""

from __future__ import annotations

import collections

import jax
import numpy as np
from keras import ops

from keras_accel.adapter.batchnorm import install_batchnorm
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.pipeline import preprocessor
from keras_accel.adapter.steps import ROW_MASK
from keras_accel.data.batching import pack, unpack
from keras_accel.data.sources import (
    ArrayBatches,
    IterableBatches,
    PyDatasetBatches,
    refuse_preprocessing,
)
from keras_accel.loop.batches import StepGroup
from keras_accel.loop.losses import per_example_losses
from keras_accel.loop.metrics import metric_updates


class Steps:
    def __init__(self, loop):
        self.loop = loop
        self.runtime = loop.accelerator.runtime
        self.traces: collections.Counter = collections.Counter()
        self._compiled: dict[str, object] = {}
        device = self.runtime.plan.devices[0]
        platform, index = device.split(":")
        self._device = next(d for d in jax.devices(platform) if d.id == int(index))

    # ------------------------------------------------------------------ data
    def _sharding(self, shape):
        distribution = self.runtime.native
        if distribution is None:
            return jax.sharding.SingleDeviceSharding(self._device)
        return distribution.get_data_layout(shape).backend_layout

    def _put(self, structure, local: bool = False):
        def put(a):
            a = np.asarray(a)
            shape = _global_shape(a.shape, 0) if local else a.shape
            return _place(a, self._sharding(shape), shape)

        return jax.tree_util.tree_map(put, structure)

    def distributed(self, batches, training: bool):
        return self.distribute(batches, training)  # Batches are gathered on the host.

    def distribute(self, batches, training: bool):
        local = getattr(batches, "own_files", None) is not None
        for element in self._host_batches(batches):
            yield self._put(element, local)

    def groups(self, batches, training: bool, n: int):
        """`StepGroup`s of n batches: stacked on the host, placed in one transfer (the batch
        axis sharded as for one batch), with a `valid` flag per slot; a last, short group is
        filled with copies that the fused step skips, so every group has one shape."""
        local = getattr(batches, "own_files", None) is not None
        chunk = []
        for element in self._host_batches(batches):
            chunk.append(element)
            if len(chunk) == n:
                yield StepGroup(self._stack(chunk, n, local), n)
                chunk = []
        if chunk:
            yield StepGroup(self._stack(chunk, n, local), len(chunk))

    def _stack(self, chunk: list, n: int, local: bool = False):
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (n - real)
        stacked = jax.tree_util.tree_map(lambda *leaves: np.stack(leaves), *chunk)

        def put(a):
            shape = _global_shape(a.shape, 1) if local else a.shape
            return _place(a, self._group_sharding(a.ndim), shape)

        placed = jax.tree_util.tree_map(put, stacked)
        valid = np.arange(n) < real
        return placed, _place(valid, self._group_sharding(1), valid.shape)

    def _group_sharding(self, ndim: int):
        distribution = self.runtime.native
        if distribution is None or ndim < 2:
            if distribution is None:
                return jax.sharding.SingleDeviceSharding(self._device)
            return jax.sharding.NamedSharding(
                distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
            )
        spec = jax.sharding.PartitionSpec(None, distribution.batch_dim_name)
        return jax.sharding.NamedSharding(distribution.device_mesh.backend_mesh, spec)

    def _host_batches(self, batches):
        """Each batch as host arrays: `pack(x, y, weights, mask)` with the user's weights
        (the loop divides by the global batch's real rows itself), or `(x, mask)`."""
        preprocess = preprocessor(self.loop.model)
        own = getattr(batches, "own_files", None)
        if own is not None:  # This process's own files: its rows of each global batch.
            elements = own.with_preprocess(preprocess).batches()
        elif isinstance(batches, IterableBatches):
            refuse_preprocessing(batches, preprocess)
            elements = batches.batches()
        elif preprocess is None and isinstance(batches, (ArrayBatches, PyDatasetBatches)):
            elements = (batches.batch(i) for i in range(len(batches)))
        else:
            # A tf.data pipeline read as numpy: a user's data set, or keras-hub's
            # preprocessing (raw strings in), which runs in tf.data as in keras-hub's fit.
            from keras_accel.data import tfdata

            if isinstance(batches, ArrayBatches):
                dataset = tfdata.array_pipeline(batches, True, preprocess)
            else:
                dataset = batches.pipeline(True, preprocess)
            elements = (unpack(e) for e in dataset.as_numpy_iterator())
        for x, y, weights, mask in elements:
            yield pack(x, y, weights, mask)

    # ------------------------------------------------------------------ state
    def _metric_variables(self):
        return [v for m in self.loop.all_metrics() for v in m.variables]

    def _state(self, kind: str):
        model = self.loop.model
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in self._metric_variables()]
        if kind == "train":
            optimizer = [v.value for v in self.loop.optimizer.variables]
            return trainable, non_trainable, optimizer, metrics
        if kind == "test":
            return trainable, non_trainable, metrics
        return trainable, non_trainable

    def _assign(self, kind: str, state) -> None:
        model = self.loop.model
        groups = [model.trainable_variables, model.non_trainable_variables]
        if kind == "train":
            groups.append(self.loop.optimizer.variables)
        groups.append(self._metric_variables())
        for variables, values in zip(groups, state):
            for variable, value in zip(variables, values):
                variable.assign(value)

    # ------------------------------------------------------------------ steps
    def _run(self, kind: str, batch, group: bool = False):
        loop = self.loop
        if kind == "train" and not loop.optimizer.built:
            loop.optimizer.build(loop.model.trainable_variables)
        key = f"{kind}_group" if group else kind
        function = self._compiled.get(key)
        if function is None:
            self._place_state(kind)
            body = {"train": self._train_fn, "test": self._test_fn, "predict": self._predict_fn}
            body = {k: _fused(fn) if group else fn for k, fn in body.items()}
            if kind == "predict":
                # Several processes: every one gets all the rows (an all-gather in the
                # program), which it reads as numpy.
                replicated = self._replicated() if jax.process_count() > 1 else None
                function = jax.jit(body[kind], out_shardings=replicated)
            else:
                # The state comes back in the layout it went in (so the second step does not
                # compile again), and replaces it: XLA may reuse its buffers.
                layout = jax.tree_util.tree_map(lambda a: a.sharding, self._state(kind))
                function = jax.jit(body[kind], donate_argnums=(0,), out_shardings=layout)
            self._compiled[key] = function
        with Patches() as patches:  # BatchNormalization over real rows, while tracing.
            install_batchnorm(patches, loop.model, None)
            return function(self._state(kind), batch)

    def _replicated(self):
        mesh = self.runtime.native.device_mesh.backend_mesh
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def _place_state(self, kind: str) -> None:
        """Every state variable on this runtime's devices: metric and optimizer variables
        that Keras made on one device are replicated over the mesh like the weights."""
        distribution = self.runtime.native
        if distribution is None:
            return
        replicated = self._replicated()
        model = self.loop.model
        groups = [model.trainable_variables, model.non_trainable_variables]
        groups += [self.loop.optimizer.variables, self._metric_variables()]
        for variables in groups:
            for variable in variables:
                if isinstance(variable.value.sharding, jax.sharding.SingleDeviceSharding):
                    variable.assign(jax.device_put(variable.value, replicated))

    def train(self, batch) -> None:
        self._assign("train", self._run("train", batch))

    def test(self, batch) -> None:
        self._assign("test", self._run("test", batch))

    def train_group(self, group) -> None:
        self._assign("train", self._run("train", group.payload, group=True))

    def test_group(self, group) -> None:
        self._assign("test", self._run("test", group.payload, group=True))

    def predict(self, batch):
        return self._run("predict", batch)

    def _forward(self, trainable, non_trainable, x, mask, training: bool):
        token = ROW_MASK.set(mask)
        try:
            return self.loop.model.stateless_call(trainable, non_trainable, x, training=training)
        finally:
            ROW_MASK.reset(token)

    def _train_fn(self, state, batch):
        self.traces["train"] += 1
        loop = self.loop
        trainable, non_trainable, optimizer_vars, metric_vars = state
        x, y, weights, mask = unpack(batch)

        def loss_of(trainable, non_trainable):
            y_pred, non_trainable = self._forward(trainable, non_trainable, x, mask, True)
            per = per_example_losses(loop.loss, y, y_pred, weights)
            # The global batch's mean over its real rows: compute_average_loss's rule.
            value = ops.sum(per) / ops.maximum(ops.sum(mask), 1.0)
            return loop.optimizer.scale_loss(value), (y_pred, non_trainable, per)

        (_, (y_pred, non_trainable, per)), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable
        )
        trainable, optimizer_vars = loop.optimizer.stateless_apply(optimizer_vars, grads, trainable)
        metric_vars = self._update_metrics(metric_vars, y, y_pred, per, weights, mask)
        return trainable, non_trainable, optimizer_vars, metric_vars

    def _test_fn(self, state, batch):
        self.traces["test"] += 1
        trainable, non_trainable, metric_vars = state
        x, y, weights, mask = unpack(batch)
        y_pred, _ = self._forward(trainable, non_trainable, x, mask, False)
        per = per_example_losses(self.loop.loss, y, y_pred, weights)
        metric_vars = self._update_metrics(metric_vars, y, y_pred, per, weights, mask)
        return trainable, non_trainable, metric_vars

    def _predict_fn(self, state, batch):
        self.traces["predict"] += 1
        trainable, non_trainable = state
        x = unpack(batch)[0]
        y_pred, _ = self._forward(trainable, non_trainable, x, None, False)
        return y_pred

    def _update_metrics(self, metric_vars, y, y_pred, per, weights, mask):
        """The metric state after one batch: `metric_updates`, applied statelessly."""
        updated, start = [], 0
        for metric, args, sample_weight in metric_updates(self.loop, y, y_pred, per, weights, mask):
            count = len(metric.variables)
            own = metric_vars[start : start + count]
            start += count
            updated.extend(metric.stateless_update_state(own, *args, sample_weight=sample_weight))
        return updated

    # ------------------------------------------------------------------ results
    def sync(self) -> None:
        return None  # Every step assigns its results to the variables.

    def metrics_reset(self) -> None:
        # reset_state() makes new arrays on the default device: lay them out again, or the
        # next step would compile anew for the other layout.
        if self._compiled:
            self._place_state("test")

    def to_host(self, outputs):
        return jax.tree_util.tree_map(np.asarray, outputs)

    def predict_masked(self, batch):
        """`(outputs, row_mask)` of one prediction batch; the mask whole on every process,
        as the outputs are."""
        mask = unpack(batch)[3]
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            mask = multihost_utils.process_allgather(mask, tiled=True)
        return self.predict(batch), mask


def _place(array: np.ndarray, sharding, shape: tuple):
    """A host array laid out as `sharding`, as the global array of `shape`. Across processes
    each one puts only the shards its own devices hold: `array` is either the same global
    batch on every process (`shape` is its own), or this process's rows of it (its own
    files), the processes' rows side by side along the batch axis in process order."""
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    if tuple(shape) != array.shape:
        return jax.make_array_from_process_local_data(sharding, array, tuple(shape))
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _global_shape(shape: tuple, axis: int) -> tuple:
    """The global shape of a process's rows of a batch (`axis`: the batch axis)."""
    if len(shape) <= axis:
        return shape
    return (*shape[:axis], shape[axis] * jax.process_count(), *shape[axis + 1 :])


def _fused(step):
    """`step(state, batch) -> state` run over a group's stacked batches in one program: the
    same scan as `fit`'s groups (`keras_accel.adapter.backends.jax_groups.scan_steps`);
    slots flagged invalid (a short last group's filler) are skipped, so a group of fewer
    steps gives exactly those steps."""
    from keras_accel.adapter.backends.jax_groups import scan_steps

    scan = scan_steps(lambda state, batch: ((), step(state, batch)), no_outputs=True)

    def steps(state, group):
        batches, valid = group
        return scan(state, batches, valid)[1]

    return steps
