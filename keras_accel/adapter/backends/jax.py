"""JAX: `keras.distribution` device meshes (DataParallel, ModelParallel)."""

from __future__ import annotations

import os
import weakref

import jax
import keras
import numpy as np
from keras import distribution as kd

from keras_accel.adapter import runtime
from keras_accel.adapter.layouts import Placement
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.pipeline import hub_layout_map
from keras_accel.adapter.sharding import fully_sharded_axes, is_replicated
from keras_accel.adapter.steps import overrides_any_step
from keras_accel.adapter.strategies import STRATEGIES, Plan, check_built
from keras_accel.data.batching import flatten
from keras_accel.data.pydataset import StaticBatchDataset, stream
from keras_accel.data.sources import (
    ArrayBatches,
    IterableBatches,
    PyDatasetBatches,
    refuse_preprocessing,
)
from keras_accel.utils import keras_internals, process
from keras_accel.utils.devices import parse_device_name
from keras_accel.utils.printing import print_msg

HEARTBEAT_TIMEOUT_S = int(os.environ.get("KERAS_ACCEL_HEARTBEAT_TIMEOUT", "100"))


def connect(cluster) -> None:
    """Join the JAX distributed runtime once, before any device is touched.

    `jax.distributed.initialize` (what `keras.distribution.initialize` calls) with what the
    environment stated; what it left unstated JAX's own cluster detection fills in. On CPU the
    processes need cross-process collectives: Gloo, unless the user chose others. A process
    whose peers stop answering fails after `KERAS_ACCEL_HEARTBEAT_TIMEOUT` seconds (JAX's
    heartbeat; 100 by default) instead of waiting for ever.
    """
    if cluster is None or jax.distributed.is_initialized():
        return
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        )
    except RuntimeError as e:
        if "before any JAX" in str(e) or "already initialized" in str(e):
            raise RuntimeError(
                f"The {cluster.source} describe a run of {cluster.num_processes or 'several'} "
                "processes, but JAX already computed something in this one, and a process "
                "joins the JAX distributed runtime only before its first computation. Create "
                "the Accelerator (or call keras.distribution.initialize()) first thing in the "
                "script, before building a model or touching an array."
            ) from e
        raise


def agree_seed(seed: int | None) -> int:
    """One seed for every process: the chief's (drawn there when `seed` is None)."""
    from jax.experimental import multihost_utils

    local = np.random.SeedSequence().entropy % 2**31 if seed is None else seed
    return int(multihost_utils.broadcast_one_to_all(np.int64(local)))


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    # JAX finds a TPU by itself; `probe_tpu` is part of the contract for TF's sake. In a
    # multi-process run these are every process's devices, ordered by process.
    found = {}
    for platform in ("tpu", "gpu", "cpu"):
        try:
            devices = jax.devices(platform)
        except RuntimeError:  # JAX raises when a platform has no backend here.
            continue
        if devices:
            ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
            found[platform] = [f"{platform}:{d.id}" for d in ordered]
    return found


def _jax_device(name: str):
    platform, index = parse_device_name(name)
    return next(d for d in jax.devices(platform) if d.id == index)


class MainThreadBatchEnds(keras.callbacks.Callback):
    """Batch-end hooks that do nothing: their presence makes Keras dispatch every
    callback's batch ends in order on the main thread (`Runtime.callbacks`)."""

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_test_batch_end(self, batch, logs=None):
        pass

    def on_predict_batch_end(self, batch, logs=None):
        pass


@STRATEGIES.builder("single", "jax", default=True)
def _single(plan: Plan, layout_map):
    return None


@STRATEGIES.builder("data_parallel", "jax", default=True)
@STRATEGIES.builder("mirrored", "jax", default=True)
@STRATEGIES.builder("tpu", "jax", default=True)
@STRATEGIES.builder("multi_worker", "jax", default=True)
def _data_parallel(plan: Plan, layout_map):
    # Several processes: each feeds its own rows of every global batch (`Runtime.wrap`);
    # Keras's auto-sharding would want a tf.data.Dataset and shard it by files.
    return kd.DataParallel(devices=list(plan.devices), auto_shard_dataset=jax.process_count() == 1)


def _layout_map_on(layout_map, mesh, default):
    """The `LayoutMap` for `mesh` from what the user passed: None (`default(mesh)`), a
    LayoutMap (bound to `mesh`), or a keras-hub model class whose backbone ships one."""
    if layout_map is None:
        return default(mesh)
    if isinstance(layout_map, kd.LayoutMap):
        return layout_map if layout_map.device_mesh is mesh else _rebind(layout_map, mesh)
    shipped = hub_layout_map(layout_map, mesh) if isinstance(layout_map, type) else None
    if shipped is None:
        shown = layout_map.__name__ if isinstance(layout_map, type) else repr(layout_map)
        raise ValueError(
            "`layout_map` must be a keras.distribution.LayoutMap, or a keras-hub model class "
            "whose backbone ships one (get_layout_map: GemmaBackbone, LlamaBackbone, "
            f"QwenBackbone, ... or their tasks, e.g. GemmaCausalLM). Received: {shown}"
        )
    return shipped


@STRATEGIES.builder("model_parallel", "jax", default=True)
def _model_parallel(plan: Plan, layout_map):
    mesh = kd.DeviceMesh(plan.mesh_shape, ["batch", "model"], list(plan.devices))
    layout_map = _layout_map_on(layout_map, mesh, default_layout_map)
    return kd.ModelParallel(
        layout_map=layout_map,
        batch_dim_name="batch",
        auto_shard_dataset=jax.process_count() == 1,
    )


class FullyShardedDataParallel(kd.ModelParallel):
    """`keras.distribution.ModelParallel` whose variables are also split over the data axis
    (`strategy="fsdp"`): each variable's layout is the `LayoutMap`'s (replicated where the
    map has none), with the data axis added on its largest free dimension that the axis
    divides (`keras_accel.adapter.sharding`). Batches are split over the same axis, so each
    device holds 1/N of the state and its 1/N of the batch; XLA gathers the weights a step
    needs and scatters the gradients back (ZeRO-3). A variable created with a layout of its
    own (an optimizer slot takes its variable's) keeps it."""

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        if not isinstance(layout, kd.TensorLayout):
            return layout  # A backend sharding given by hand: the user's.
        mesh = self.device_mesh
        size = mesh.shape[mesh.axis_names.index(self.batch_dim_name)]
        axes = fully_sharded_axes(variable.shape, layout.axes, self.batch_dim_name, size)
        if axes == tuple(layout.axes):
            return layout
        return kd.TensorLayout(axes, mesh)


_NOTED: weakref.WeakSet = weakref.WeakSet()


def _note_replicated(model, distribution) -> None:
    """Say once per model which of its weights `fsdp` keeps whole on every device (no
    dimension the data axis divides): each costs its full size on every device."""
    if model in _NOTED or jax.process_index() != 0:  # Said once, by the chief.
        return
    _NOTED.add(model)
    mesh = distribution.device_mesh
    size = mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)]
    if size == 1:  # One device along the data axis: nothing is split, nothing to say.
        return
    whole = [
        f"{v.path} {tuple(v.shape)}"
        for v in model.weights
        if len(v.shape) and is_replicated(distribution.get_variable_layout(v).axes)
    ]
    if whole:
        shown = ", ".join(whole[:5]) + (f" and {len(whole) - 5} more" if len(whole) > 5 else "")
        print_msg(
            f"keras_accel: fsdp keeps {len(whole)} weight(s) whole on every device, no "
            f"dimension being a multiple of the data axis ({size}): {shown}."
        )


def _note_shipped_layout(model, mesh, strategy: str) -> None:
    """Say once per model when its keras-hub class ships a layout map that was not used
    (the model was laid out by the default rule when it was made)."""
    if model in _NOTED_LAYOUT or jax.process_index() != 0:  # Said once, by the chief.
        return
    _NOTED_LAYOUT.add(model)
    try:
        shipped = hub_layout_map(type(model), mesh)
    except Exception:  # Not keras-hub's (a get_layout_map of another shape), or another mesh.
        shipped = None
    if shipped is not None:
        name = type(model).__name__
        print_msg(
            f"keras_accel: {name} ships a layout map, unused here (its variables follow "
            f"the default rule). Accelerator(strategy={strategy!r}, layout_map=keras_hub."
            f"models.{name}) lays it out by its own, when built inside acc.scope()."
        )


_NOTED_LAYOUT: weakref.WeakSet = weakref.WeakSet()


@STRATEGIES.builder("fsdp", "jax", default=True)
def _fsdp(plan: Plan, layout_map):
    mesh = kd.DeviceMesh(plan.mesh_shape, ["batch", "model"], list(plan.devices))
    # By default Dense outputs over the model axis, where it has more than one device.
    layout_map = _layout_map_on(
        layout_map, mesh, default_layout_map if plan.mesh_shape[1] > 1 else kd.LayoutMap
    )
    return FullyShardedDataParallel(
        layout_map=layout_map,
        batch_dim_name="batch",
        auto_shard_dataset=jax.process_count() == 1,
    )


# One runtime runs every strategy on JAX: the Distribution the builder made is the whole
# strategy (its layouts), and one compiled, global-view program runs it, whatever its name.
@STRATEGIES.runtime("single", "jax", default=True)
@STRATEGIES.runtime("data_parallel", "jax", default=True)
@STRATEGIES.runtime("mirrored", "jax", default=True)
@STRATEGIES.runtime("tpu", "jax", default=True)
@STRATEGIES.runtime("multi_worker", "jax", default=True)
@STRATEGIES.runtime("model_parallel", "jax", default=True)
@STRATEGIES.runtime("fsdp", "jax", default=True)
class Runtime(runtime.Runtime):
    """A `keras.distribution` Distribution (or a single device) built from a `Plan`."""

    all_reduce_sum = None  # jit programs are global-view: sums already span every replica.

    def __init__(self, plan: Plan, native, layout_map_given: bool = False):
        super().__init__(plan, native)
        self._devices = {_jax_device(name) for name in plan.devices}
        self.layout_map_given = layout_map_given

    def own_files(self, batches):
        """This process's own files of a file-backed tf.data pipeline (`batches`), where
        every process can read its own (`keras_accel.data.tfdata.ProcessFiles`), else None:
        each process then reads the whole pipeline and keeps its rows of each global batch."""
        from keras_accel.data import tfdata

        rows = self.process_rows(batches.plan.static_rows)
        own = tfdata.process_files(batches, jax.process_count(), jax.process_index())
        if own is not None and rows.stop - rows.start != own.plan.static_rows:
            own = None  # This process's devices hold another share than 1/count of a batch.
        return own if agree_all(own is not None) else None

    def own_rows(self, source, num_replicas: int, remainder: str, training: bool):
        """A batched Grain `MapDataset` that every process reads only its own rows of: the
        block of each global batch that its devices hold (`keras_accel.data.grain.
        process_share`), where every process can; else None (each reads it all, and keeps
        its rows of each batch)."""
        from keras_accel.data import grain

        count = jax.process_count()
        static_rows = grain.shared_static_rows(source, count, num_replicas, remainder)
        rows = None if static_rows is None else self.process_rows(static_rows)
        block = None if static_rows is None else static_rows // count
        fits = rows is not None and rows.stop - rows.start == block and rows.start % block == 0
        if not agree_all(fits):
            return None
        position = rows.start // block
        return grain.process_share(source, count, position, num_replicas, remainder, training)

    def process_rows(self, static_rows: int) -> slice | None:
        """The rows of a global batch that this process feeds, in a multi-process run
        (None in one process): those its devices hold under the data layout."""
        if jax.process_count() == 1 or self.native is None:
            return None
        layout = self.native.get_data_layout((static_rows,)).backend_layout
        held = layout.addressable_devices_indices_map((static_rows,)).values()
        spans = sorted({(index[0].start or 0, index[0].stop or static_rows) for index in held})
        start, stop = spans[0][0], spans[-1][1]
        covered = sum(b - a for a, b in spans)
        if covered != stop - start:
            raise ValueError(
                f"This process's devices hold rows {spans} of each batch of {static_rows}: not "
                "one contiguous range, which a process feeds. Order the devices by process "
                "(the default), or use a mesh whose batch axis keeps each process's devices "
                "together."
            )
        return slice(start, stop)

    @property
    def whole_remainder(self) -> str | None:
        """One program holds the global batch, on any number of devices and processes: a
        short last batch is padded to the others' shape and cut to its real rows inside the
        step ("cut"), where the compiler splits them over the devices as it can; on one
        device a batch of its real rows ("whole")."""
        return "whole" if self.native is None else "cut"

    @property
    def whole_pipeline_remainder(self) -> str | None:
        """A tf.data pipeline's batch with padding marked in its graph ("cut") in one
        process; over several, each keeps its share of a pipeline's batches
        (`keras_accel.data.tf_shares`), not marked: None."""
        if self.native is not None and jax.process_count() > 1:
            return None
        return self.whole_remainder

    def device_scope(self):
        return jax.default_device(_jax_device(self.plan.devices[0]))

    def make_function(self, model, kind: str):
        """N > 1 steps per call in one compiled program (`jax_groups.GroupedSteps`: a scan
        over the group's batches). Keras 3.15 runs them as a host loop; 3.16 scans full
        groups itself and unrolls a short last one into single steps (another program): ours
        runs every group, short ones too, in one program. None: Keras's function."""
        n = int(getattr(model, "steps_per_execution", 1) or 1)
        if n == 1 or model.run_eagerly or not model.jit_compile:
            return None
        from keras_accel.adapter.backends.jax_groups import GroupedSteps

        # Scanned or a call per step, measured (`GroupedSteps`), on values every process
        # agrees on where there are several.
        return GroupedSteps(model, kind, agree=agree_max if process.num_processes() > 1 else None)

    def fuses_predictions(self, model) -> bool:
        """Our groups return every slot's predictions in one shape (`GroupedSteps`)."""
        return not model.run_eagerly and bool(model.jit_compile)

    def reads_steps_per_execution(self, model, kind: str) -> bool:
        """The step function for N > 1 reads N at each call (ours, `GroupedSteps`, runs any
        N up to the largest it compiled; Keras's is a Python loop over one jitted step):
        one function serves every N > 1."""
        return int(getattr(model, "steps_per_execution", 1) or 1) > 1

    def variable_misplaced(self, variable) -> str | None:
        """Why `variable` is not laid out over this runtime's devices, or None."""
        sharding = getattr(variable.value, "sharding", None)
        placed = set(sharding.device_set) if sharding is not None else set()
        if placed >= self._devices:
            return None
        return f"lives on {len(placed)} device(s)"

    def placement(self, variable) -> Placement:
        """Where `variable`'s `jax.Array` lies: its sharding's spec ("replicated" where it
        splits nothing), the block each device holds, over how many devices."""
        value = variable.value
        sharding = value.sharding
        spec = getattr(sharding, "spec", None)
        if spec is not None and any(axis is not None for axis in spec):
            layout = str(spec)
        elif len(sharding.device_set) > 1:
            layout = "replicated"
        else:
            device = next(iter(sharding.device_set))
            layout = f"{device.platform}:{device.id}"
        return Placement(
            layout=layout,
            per_device_shape=tuple(sharding.shard_shape(value.shape)),
            num_devices=len(sharding.device_set),
            itemsize=value.dtype.itemsize,
        )

    def callbacks(self) -> list:
        """Callbacks each Keras call of ours runs beside the user's.

        Keras runs batch-end callbacks in a thread pool where no callback needs them in
        order; their reads of the logs, beside the main thread's next dispatches,
        deadlocked two processes' collectives (reproduced: the quickstart under
        `keras-accel launch`, in its second epoch, both times). Across processes one
        callback with batch-end hooks makes Keras run them all on the main thread, as on
        TF, by Keras's own rule (`CallbackList`), for this call's callback list only."""
        if self.native is not None and jax.process_count() > 1:
            return [MainThreadBatchEnds()]
        return []

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        if isinstance(self.native, FullyShardedDataParallel):
            _note_replicated(model, self.native)
        if isinstance(self.native, kd.ModelParallel) and not self.layout_map_given:
            _note_shipped_layout(model, self.native.device_mesh, self.plan.strategy)
        if first_batch is None:
            return
        # Keras builds a model symbolically from the first batch it reads; ours carries the
        # row mask, which only our step wrappers understand: build from the batch the
        # model's step sees instead.
        keras_internals.install_symbolic_build(
            patches, model, first_batch, overrides_a_step=overrides_any_step(model)
        )

    def install_outer(self, patches: Patches, model) -> None:
        if self.native is not None and jax.process_count() > 1:
            _install_replicated_predictions(patches, model, self.native)

    def _one_cpu_device(self) -> bool:
        return self.native is None and self.plan.devices[0].startswith("cpu:")

    def place_batch(self, batch):
        """`batch`'s numeric arrays on the devices, laid out as the step takes them: the
        distribution's data layout (what Keras's trainer would place them with), or the one
        device. The transfer is asynchronous: this returns before it ends."""
        distribution = self.native
        device = _jax_device(self.plan.devices[0]) if distribution is None else None

        def put(leaf):
            if not isinstance(leaf, np.ndarray) or leaf.dtype.kind not in "biufc":
                return leaf
            if distribution is None:
                return jax.device_put(leaf, device)
            return jax.device_put(leaf, distribution.get_data_layout(leaf.shape).backend_layout)

        return keras.tree.map_structure(put, batch)

    def grouped(self, batches, model, kind: str, steps_per_call: int, preprocess=None):
        """In-memory `batches` a group of `steps_per_call` at a time (`data.groups`), where
        our grouped step function reads them (N > 1 train or test steps, compiled) on one
        CPU device, else None: `wrap` gives them one by one. Off the CPU the batches go
        one at a time, placed one batch ahead (`OneBatchAhead`)."""
        from keras_accel.data.groups import ArrayGroupPasses

        if (
            not self._one_cpu_device()
            or not self.groups_arrays(batches, model, kind, steps_per_call, preprocess)
            or self.process_rows(batches.plan.static_rows) is not None
        ):
            return None
        return ArrayGroupPasses(batches, steps_per_call)

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        if preprocess is None:
            _refuse_text(batches)
        rows = self.process_rows(batches.plan.static_rows)
        own = getattr(batches, "own_files", None)
        if own is not None and carry_mask:
            from keras_accel.data.grain import GrainPasses

            return GrainPasses(own.with_preprocess(preprocess), carry_mask=True)
        if isinstance(batches, IterableBatches):
            refuse_preprocessing(batches, preprocess)
            return stream(batches, carry_mask=carry_mask, rows=rows)
        if isinstance(batches, PyDatasetBatches) or (
            isinstance(batches, ArrayBatches) and preprocess is None
        ):
            dataset = StaticBatchDataset(batches, carry_mask=carry_mask, rows=rows)
            from keras_accel.data.ahead import OneBatchAhead

            if not carry_mask or rows is not None:
                # `Accelerator.dataset` (a PyDataset, as it says); this process's rows of each
                # batch, which Keras assembles into the global batch as it places them.
                return dataset
            if self._one_cpu_device():
                # One CPU device, where Keras looks ahead neither (measured: about 5% slower
                # with the look-ahead there, docs/benchmarks.md). Keras 3.16 stacks a
                # PyDataset's groups with `jnp.stack`, one conversion per numpy batch
                # (measured: 3/5 of an epoch of the small model at batch 64); our adapter
                # stacks them on the host, as they are.
                if keras_internals.keras_scans_steps():
                    return OneBatchAhead(dataset, _as_it_is)
                return dataset
            return OneBatchAhead(dataset, self.place_batch)
        # tf.data inputs, and keras-hub preprocessing (which runs in tf.data, as keras-hub's
        # own fit does on JAX): Keras's JAX trainer reads tf.data batches as numpy.
        from keras_accel.data import tfdata

        if isinstance(batches, ArrayBatches):
            pipeline = tfdata.array_pipeline(batches, carry_mask, preprocess)
        else:
            pipeline = batches.pipeline(carry_mask, preprocess)
        return pipeline if rows is None else tfdata.take_rows(pipeline, rows)


def _as_it_is(batch):
    return batch


def agree_all(flag: bool) -> bool:
    """True where `flag` is true in every process."""
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def agree_max(values: list[float]) -> list[float]:
    """Every process's elementwise maximum of `values` (the same length everywhere)."""
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(values, np.float64))
    return [float(v) for v in np.max(np.asarray(gathered).reshape(-1, len(values)), axis=0)]


def _install_replicated_predictions(patches: Patches, model, distribution) -> None:
    """In a multi-process run, predictions come back whole on every process: the step's
    outputs are laid out replicated (one all-gather in the program), so that Keras can read
    them as numpy where it would otherwise hold a global array spanning other processes'
    devices."""
    replicated = jax.sharding.NamedSharding(
        distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
    )
    original = model.predict_step

    def predict_step(state, data):
        outputs, non_trainable_variables = original(state, data)
        outputs = jax.tree.map(lambda t: jax.lax.with_sharding_constraint(t, replicated), outputs)
        return outputs, non_trainable_variables

    patches.set(model, "predict_step", predict_step)


def _refuse_text(batches) -> None:
    """JAX arrays hold numbers only: text must become numbers before the compiled step."""
    x = getattr(batches, "x", None)
    leaves = [leaf for leaf in flatten(x) if getattr(leaf, "dtype", None) is not None]
    text = [leaf for leaf in leaves if np.dtype(leaf.dtype).kind in "OUS"]
    if text:
        raise ValueError(
            f"KERAS_BACKEND=jax cannot feed text to a compiled model: JAX arrays hold numbers "
            f"only. Received: x with a {text[0].dtype} array of shape {text[0].shape}. Turn "
            "the text into numbers first: a keras-hub task with its preprocessor (which "
            "keras_accel runs in tf.data, as keras-hub does), or TextVectorization mapped over "
            "a tf.data.Dataset; or use KERAS_BACKEND=tensorflow, where a model may take "
            "strings."
        )


def default_layout_map(mesh):
    """Shard the output axis of every Dense kernel over the "model" axis; replicate the rest."""
    layout_map = kd.LayoutMap(mesh)
    layout_map[r".*dense.*kernel"] = (None, "model")
    layout_map[r".*dense.*bias"] = ("model",)
    return layout_map


def _rebind(layout_map, mesh):
    rebound = kd.LayoutMap(mesh)
    for key in layout_map:
        rebound[key] = layout_map[key].axes
    return rebound


def build(plan: Plan, layout_map=None) -> Runtime:
    native = STRATEGIES.build(plan, "jax", layout_map)
    if isinstance(getattr(native, "device_mesh", None), kd.DeviceMesh):  # A Distribution.
        mesh = native.device_mesh
        name = getattr(native, "batch_dim_name", None) or mesh.axis_names[0]
        replicas = mesh.shape[mesh.axis_names.index(name)]
        check_built(plan, native, replicas, int(np.prod(mesh.shape)))
    elif native is not None:
        raise TypeError(
            f"On JAX a strategy's builder returns a keras.distribution.Distribution or None. "
            f"Received: {type(native).__name__} from the builder of strategy={plan.strategy!r}"
        )
    runtime_class = STRATEGIES.runtime_class(plan.strategy, "jax", Runtime)
    return runtime_class(plan, native, layout_map_given=layout_map is not None)


def backend_versions() -> dict[str, str]:
    return {"jax": jax.__version__, "keras": keras.__version__}
