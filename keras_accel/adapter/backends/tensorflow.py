"""TensorFlow: `tf.distribute` strategies (OneDevice, Mirrored, TPU)."""

from __future__ import annotations

import contextlib
import contextvars
import glob
import os
import threading

import keras
import tensorflow as tf

from keras_accel.adapter import guard
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import install_global_results, overrides_any_step
from keras_accel.adapter.strategies import Plan
from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.data.pydataset import StaticBatchDataset, stream
from keras_accel.data.sources import ArrayBatches, IterableBatches, refuse_preprocessing
from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer

TPU_TIMEOUT_S = float(os.environ.get("KERAS_ACCEL_TPU_TIMEOUT", "60"))

_tpu_resolver = None  # The TPU system is initialized once per process.


def tpu_hint() -> str | None:
    """Where a TPU might be, without touching the network: an address, a name, or a device."""
    for var in ("KERAS_ACCEL_TPU", "TPU_NAME", "COLAB_TPU_ADDR"):
        value = os.environ.get(var)
        if value:
            return value if var != "COLAB_TPU_ADDR" else f"grpc://{value}"
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return "local"  # A TPU VM: the resolver finds it with tpu="local".
    return None


def connect_tpu(timeout_s: float = TPU_TIMEOUT_S):
    """Resolve, connect and initialize the TPU system once; bounded, never a hang."""
    global _tpu_resolver
    if _tpu_resolver is not None:
        return _tpu_resolver
    hint = tpu_hint()
    if hint is None:
        return None
    result: dict = {}

    def work():
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=hint)
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
            result["resolver"] = resolver
        except Exception as e:  # Reported below with the address that failed.
            result["error"] = e

    thread = threading.Thread(target=work, daemon=True, name="keras_accel-tpu-connect")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(
            f"No answer from the TPU at {hint!r} within {timeout_s:.0f} s. Check the address "
            "(KERAS_ACCEL_TPU, TPU_NAME or COLAB_TPU_ADDR), or raise KERAS_ACCEL_TPU_TIMEOUT."
        )
    if "error" in result:
        raise RuntimeError(f"Could not connect to the TPU at {hint!r}: {result['error']}")
    _tpu_resolver = result["resolver"]
    return _tpu_resolver


_multi_worker = None  # One MultiWorkerMirroredStrategy per process, made before any op.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("KERAS_ACCEL_COLLECTIVE_TIMEOUT", "120"))


def connect(cluster) -> None:
    """Join a TF_CONFIG cluster: `MultiWorkerMirroredStrategy` must exist before TensorFlow
    runs its first op (it configures the collective runtime), so it is made here, before the
    device inventory. Collectives give up after `KERAS_ACCEL_COLLECTIVE_TIMEOUT` seconds (120
    by default) when a worker stops answering, instead of waiting for ever."""
    global _multi_worker
    if cluster is None or _multi_worker is not None:
        return
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=COLLECTIVE_TIMEOUT_S)
    try:
        _multi_worker = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except RuntimeError as e:
        raise RuntimeError(
            f"TF_CONFIG describes {cluster.num_processes} workers, but TensorFlow already ran "
            "an op in this process, and MultiWorkerMirroredStrategy must be created before the "
            "first one. Create the Accelerator first thing in the script, before building a "
            f"model or touching a tensor. ({e})"
        ) from e


def agree_seed(seed: int | None) -> int:
    """One seed for every worker: the chief's (drawn there when `seed` is None)."""
    import numpy as np

    from keras_accel.utils import process

    strategy = _multi_worker
    local = int(np.random.SeedSequence().entropy % 2**31) if seed is None else seed
    mine = tf.constant(local if process.is_chief() else 0, tf.int64)
    per_worker = strategy.num_replicas_in_sync // process.num_processes()

    @tf.function
    def broadcast():
        return strategy.reduce("SUM", strategy.run(lambda: tf.identity(mine)), axis=None)

    return int(broadcast().numpy()) // per_worker


def agree_all(flag: bool) -> bool:
    """True where `flag` is true on every worker (one all-reduce over the workers)."""
    strategy = _multi_worker
    mine = tf.constant(1 if flag else 0, tf.int64)

    @tf.function
    def count():
        return strategy.reduce("SUM", strategy.run(lambda: tf.identity(mine)), axis=None)

    return int(count().numpy()) == strategy.num_replicas_in_sync


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    found = {}
    if probe_tpu and connect_tpu() is not None:
        found["tpu"] = [f"tpu:{i}" for i in range(len(tf.config.list_logical_devices("TPU")))]
    for platform in ("GPU", "CPU"):
        devices = tf.config.list_logical_devices(platform)
        if devices:
            found[platform.lower()] = [f"{platform.lower()}:{i}" for i in range(len(devices))]
    return found


def _tf_name(device: str) -> str:
    platform, index = device.split(":")
    return f"/device:{platform.upper()}:{index}"


def _global_result(metric, result):
    """`metric`'s result over every replica's rows, from inside a replica: its variables
    reduced as a cross-replica read would reduce them (Keras's are SUM, on read)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return result()
    operations = {
        tf.VariableAggregation.SUM: tf.distribute.ReduceOp.SUM,
        tf.VariableAggregation.MEAN: tf.distribute.ReduceOp.MEAN,
    }
    values = []
    for variable in metric.variables:
        operation = operations.get(getattr(variable.value, "aggregation", None))
        # tf.identity places the read on this replica's device: a read of a metric's
        # variable carries none under MultiWorkerMirroredStrategy, and its collective then
        # fails ("destinations can not be empty").
        local = tf.identity(tf.convert_to_tensor(variable.value))
        values.append(local if operation is None else context.all_reduce(operation, local))
    with keras.StatelessScope(state_mapping=list(zip(metric.variables, values))):
        return result()


def all_reduce_sum(tensors):
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensors
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


def _reduce_logs(values, strategy, reduction):
    """Keras's `reduce_per_replica`, except for the logs of a multi-worker step.

    There Keras 3 reduces every log with `strategy.reduce("MEAN", v, axis=0)`, which fails
    for the scalar logs every step returns ("Invalid reduction dimension (0 for input with 0
    dimension(s))", the second half of keras-team/keras#20585). Here they are averaged over
    every replica, as Keras means to ("mean"), in one batched all-reduce: the compiled
    metrics' results are already global in every replica (`install_global_results`), so
    their mean is that value; a custom step's own local logs get the mean over all workers,
    as MirroredStrategy gives them over its replicas.
    """
    if (
        reduction not in ("auto", "mean")
        or not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        or id(strategy) not in _OURS
    ):
        return _KERAS_REDUCE(values, strategy, reduction)
    leaves = tf.nest.flatten(values)
    picked = [
        i
        for i, v in enumerate(leaves)
        if isinstance(v, tf.distribute.DistributedValues)
        and strategy.experimental_local_results(v)[0].dtype.is_floating
    ]
    if picked:

        def mean(*local):
            context = tf.distribute.get_replica_context()
            return context.all_reduce(tf.distribute.ReduceOp.MEAN, list(local))

        reduced = strategy.run(mean, args=tuple(leaves[i] for i in picked))
        for i, v in zip(picked, reduced):
            leaves[i] = strategy.experimental_local_results(v)[0]
    leaves = [
        strategy.experimental_local_results(v)[0]
        if isinstance(v, tf.distribute.DistributedValues)
        else v
        for v in leaves
    ]
    return tf.nest.pack_sequence_as(values, leaves)


# Keras's, read before any call patches the module's name with `_reduce_logs`.
_KERAS_REDUCE = keras_internals.reduce_per_replica()


def fused_function(model, kind: str):
    """Up to N train (or test) steps in one `tf.function`, as Keras's TF function for
    `steps_per_execution` = N, in a form that also runs under a tf.distribute strategy.
    N is the model's `steps_per_execution` at each call, a tensor of the program: one
    compiled program runs every N > 1 (as Keras's JAX function does), so that a call
    fusing another N than the last (an `evaluate` after `fit`'s validation) does not
    compile its step again.

    Keras's own puts each step in a `tf.cond` (inside its while-loop) around a nested
    `tf.function`; under MirroredStrategy the replicas' merge_call then fails ("You must feed
    a value for placeholder tensor 'while/cond/Placeholder'", keras-team/keras#19246, also
    with plain Keras). Here the steps are the body of a `tf.while_loop` and only fetching
    the next batch is conditional, as tf.keras did. The loop stops after n steps or when the
    data ends (a last group of fewer steps, same program): the logs are the last step's.
    """
    step = getattr(model, f"{kind}_step")
    strategy = model.distribute_strategy
    reduce = _reduce_logs
    # The per-replica shapes of the first call site's batch. The loop body's batch comes
    # out of `get_next_as_optional` with its batch dimension unknown; a step that reads a
    # static size there (Keras's per-output loss trackers weight each batch's loss by
    # `y_pred.shape[0]`, and count it once when that is None) would then see another batch
    # than the first call site, so it is given the same static shapes.
    shapes: list = []

    def replica_step(data):
        leaves = tf.nest.flatten(data)
        if not shapes:
            shapes.extend(getattr(leaf, "shape", None) for leaf in leaves)
        else:
            leaves = [_with_shape(leaf, shape) for leaf, shape in zip(leaves, shapes)]
            data = tf.nest.pack_sequence_as(data, leaves)
        return step(data)

    def one(data):
        outputs = strategy.run(replica_step, args=(data,))
        return reduce(outputs, strategy, reduction="auto")

    if model.jit_compile:  # As Keras compiles one step: with XLA where the model asks.
        one = tf.function(one, jit_compile=True, reduce_retracing=True)

    @tf.function
    def steps(iterator, n):
        shapes.clear()  # Each trace records its own first batch.
        outputs = one(next(iterator))

        def more(i, optional, outputs):
            return tf.logical_and(i < n, optional.has_value())

        def body(i, optional, outputs):
            # The same step again, in the same program (inlined: a nested function here
            # makes TensorFlow's compilation several times slower under a strategy).
            with guard.same_program(model):
                outputs = one(optional.get_value())
            optional = tf.cond(i + 1 < n, iterator.get_next_as_optional, lambda: optional)
            return i + 1, optional, outputs

        first = (tf.constant(1), iterator.get_next_as_optional(), outputs)
        return tf.while_loop(more, body, first)[2]

    def function(iterator):
        return steps(iterator, tf.constant(int(model.steps_per_execution), tf.int32))

    return function


def _with_shape(leaf, shape):
    if not isinstance(leaf, tf.Tensor) or shape is None or not leaf.shape.is_compatible_with(shape):
        return leaf
    leaf = tf.identity(leaf)
    leaf.set_shape(shape)
    return leaf


class _MirroredStrategy(tf.distribute.MirroredStrategy):
    """A MirroredStrategy whose collective keys cannot clash with another strategy's.

    Every `tf.distribute.MirroredStrategy` numbers its collective groups and instances from
    the same start, so two strategies over the same devices in one process (a user's raw
    one and ours, in either order) send different tensors under the same keys and abort each
    other ("Shape mismatch in the collective instance"; then "Function was cancelled"). Ours
    start from a base of their own.
    """

    def __init__(self, devices, key_base: int):
        self._collective_key_base = key_base  # Read by MirroredExtended's __init__.
        super().__init__(devices)


_MIRRORED: dict[tuple, tf.distribute.MirroredStrategy] = {}
_KEY_BASE = 1 << 20  # Far above the keys a raw strategy hands out in one process.


def _mirrored(devices: tuple) -> tf.distribute.MirroredStrategy:
    # One strategy per device set and process: ours must not clash with each other either.
    if devices not in _MIRRORED:
        base = _KEY_BASE * (len(_MIRRORED) + 1)
        _MIRRORED[devices] = _MirroredStrategy([_tf_name(d) for d in devices], base)
    return _MIRRORED[devices]


class Runtime:
    """A `tf.distribute` strategy built from a `Plan`."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.num_replicas = plan.num_replicas
        if plan.strategy == "model_parallel":
            raise ValueError(
                "strategy='model_parallel' needs the JAX backend (keras.distribution "
                "ModelParallel); tf.distribute has no equivalent in Keras 3. Received: "
                "KERAS_BACKEND=tensorflow. Use KERAS_BACKEND=jax, or strategy='data_parallel'."
            )
        if plan.strategy == "tpu":
            self.native = tf.distribute.TPUStrategy(connect_tpu())
        elif plan.strategy == "single":
            self.native = None
        elif plan.strategy == "multi_worker":
            self.native = _multi_worker
            if self.native.num_replicas_in_sync != plan.num_replicas:
                raise RuntimeError(
                    f"MultiWorkerMirroredStrategy has {self.native.num_replicas_in_sync} "
                    f"replicas where {plan.num_replicas} were planned ({plan.devices} per "
                    "worker): every worker must see the same devices."
                )
        else:
            self.native = _mirrored(tuple(plan.devices))
        # BatchNormalization sums its moments across replicas (see adapter.batchnorm).
        self.all_reduce_sum = all_reduce_sum if self.num_replicas > 1 else None

    @contextlib.contextmanager
    def scope(self):
        _check_not_nested(self.native)
        if self.native is None:
            with tf.device(_tf_name(self.plan.devices[0])):
                yield
        else:
            with self.native.scope():
                yield

    def model_misplaced(self, model) -> str | None:
        """Why `model` would not run under this runtime's strategy, or None."""
        _check_not_nested(self.native)  # Else the advice below leads back into the scope.
        strategy = keras_internals.distribute_strategy_of(model)
        if strategy is self.native:
            return None
        # Keras trains such a model on one device without a word.
        owner = "no strategy" if strategy is None else f"another {type(strategy).__name__}"
        return f"it belongs to {owner}"

    def variable_misplaced(self, variable) -> str | None:
        """Why `variable` was not created under this runtime's strategy, or None."""
        strategy = getattr(variable.value, "distribute_strategy", None)
        if strategy is self.native:
            return None
        return "is a plain variable" if strategy is None else "belongs to another strategy"

    def make_function(self, model, kind: str):
        """Keras's step function for `kind`, or ours where Keras's cannot run: N > 1 fused
        train or test steps (see `fused_function`). None: Keras makes its own."""
        if not self.reads_steps_per_execution(model, kind):
            return None
        return fused_function(model, kind)

    def reads_steps_per_execution(self, model, kind: str) -> bool:
        """Whether `kind`'s step function reads N > 1 at each call (ours, fused), so that
        one function serves every N > 1; Keras's own TF function compiles N in."""
        n = int(getattr(model, "steps_per_execution", 1) or 1)
        return n > 1 and kind != "predict" and not model.run_eagerly

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        if self.native is not None and first_batch is not None:
            # Keras builds a model from the first batch it reads (under a strategy, reduced
            # across replicas with MEAN first, which fails for strings and booleans: raw
            # text, keras-hub padding masks). Ours carries the row mask, which only our step
            # wrappers understand: build from the batch the model's step sees instead.
            keras_internals.install_symbolic_build(
                patches, model, first_batch, overrides_a_step=overrides_any_step(model)
            )
            keras_internals.require(model, "_maybe_symbolic_build", "the TF trainer's build")

            def build(iterator=None, data_batch=None):
                model._symbolic_build()

            patches.set(model, "_maybe_symbolic_build", build)
        if self.plan.strategy == "multi_worker":
            share(patches, self.native, "reduce_per_replica", _install_reduce_logs)
        if self.num_replicas > 1:
            if training:
                _check_optimizers_built(model)
                for optimizer in _optimizers(model):
                    check_gradient_accumulation(optimizer, self.num_replicas)
            install_global_batch_losses(patches, self.native)
            install_global_results(patches, model, _global_result)

    def row_count(self, row_mask):
        # Each replica weights its share of the epoch's loss average by the global batch's
        # real rows over the replica count: summed over replicas, the real rows.
        (total,) = all_reduce_sum([tf.reduce_sum(tf.cast(row_mask, tf.float32))])
        return total / self.num_replicas

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        from keras_accel.data import tfdata

        if isinstance(batches, ArrayBatches):
            pipeline = tfdata.array_pipeline(batches, carry_mask, preprocess)
        elif isinstance(batches, tfdata.TFDatasetBatches):
            own = batches.own_files if carry_mask else None
            if own is not None:  # This worker's own files: its rows of each global batch.
                mine = own.pipeline(carry_mask, preprocess)
                distributed = self.distribute(mine, own.plan.static_rows, own=True)
                return DistributedBatches(distributed, mine, num_batches=None)
            pipeline = batches.pipeline(carry_mask, preprocess)
        elif self.plan.strategy == "multi_worker":
            raise ValueError(
                "Under MultiWorkerMirroredStrategy keras_accel feeds each worker its rows of "
                "every global batch through tf.data; a keras.utils.PyDataset, a generator or a "
                "Grain data set has no tf.data form here. Received: "
                f"{type(batches.source).__name__}. Pass arrays or a tf.data.Dataset."
            )
        elif isinstance(batches, IterableBatches):
            refuse_preprocessing(batches, preprocess)
            return stream(batches, carry_mask=carry_mask)  # Keras's route for generators.
        else:
            # A user's PyDataset: Keras's own route (tf.data from a generator).
            return StaticBatchDataset(batches, carry_mask=carry_mask)
        if self.native is None or self.plan.strategy == "tpu":
            return pipeline  # Keras distributes it (TPU: experimental_distribute_dataset).
        if not carry_mask and self.plan.strategy != "multi_worker":
            return pipeline  # `Accelerator.dataset`: a tf.data.Dataset, as it says.
        distributed = self.distribute(pipeline, batches.plan.static_rows)
        return DistributedBatches(distributed, pipeline, num_batches=batches.plan.num_batches)

    def distribute(self, pipeline, static_rows: int, own: bool = False):
        """Global batches of `static_rows` rows as the strategy's distributed data set: each
        worker keeps its rows of every global batch (the same batches on every worker: same
        order, same padding), and each of its replicas gets its slice of those. `own`: the
        pipeline already holds only this worker's rows (its own files, `static_rows` each).

        MirroredStrategy's own `experimental_distribute_dataset` splits each batch the same
        way, but first serializes and clones the pipeline's graph for the workers' devices;
        an in-memory array pipeline holds the arrays in its graph, so that copied them (a
        CIFAR-10-sized training set cost 190 MiB more at the peak than this, 8 replicas).
        Across workers this is what auto-sharding by data would do, except that it shards
        rows of each batch, not whole batches: whole batches would give each worker other
        global batches."""
        from keras_accel.data import tfdata
        from keras_accel.utils import process

        if self.plan.strategy == "tpu":
            return self.native.experimental_distribute_dataset(pipeline)
        if self.plan.strategy == "multi_worker" and not own:
            share = static_rows // process.num_processes()
            index = process.process_index()
            pipeline = tfdata.take_rows(pipeline, slice(index * share, (index + 1) * share))
        return self._distribute(pipeline)

    def own_files(self, batches):
        """Under MultiWorkerMirroredStrategy, this worker's own files of a file-backed
        pipeline where every worker can read its own (`keras_accel.data.tfdata.
        ProcessFiles`), else None. Where the workers' data end after different numbers of
        batches, `tf.distribute`'s partial-batch handling feeds an empty batch to a worker
        that ran out, as long as another has data (its `get_next_as_optional` all-reduces
        which workers have a batch, every step): the step weights nothing there."""
        from keras_accel.data import tfdata
        from keras_accel.utils import process

        if self.plan.strategy != "multi_worker":
            return None
        own = tfdata.process_files(batches, process.num_processes(), process.process_index())
        return own if agree_all(own is not None) else None

    def _distribute(self, mine):
        """`mine` (this worker's rows of each global batch) as the strategy's distributed
        data set, each batch cut into its local replicas' slices."""
        from keras_accel.data import tfdata

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        local = len(self.native.extended.worker_devices)
        slices = tfdata.replica_slices(mine, local).with_options(options)
        return self.native.distribute_datasets_from_function(lambda context: slices)


class DistributedBatches(PaddedBatchesAdapter):
    """A distributed data set of ours as Keras's TF trainer reads it: a Keras `DataAdapter`
    (Keras's TF epoch iterator takes a `DistributedDataset` as it is) whose length is in
    global batches. The distributed data set's own cardinality counts its replicas'
    slices, one element each.

    `keras_accel_local` is the undistributed pipeline, what the model is built from
    (`keras_accel.adapter.accelerator._first_batch`)."""

    feeds = "TensorFlow's trainer"

    def __init__(self, distributed, local, num_batches: int | None):
        self.distributed = distributed
        self.keras_accel_local = local
        self._num_batches = num_batches

    def get_tf_dataset(self):
        return self.distributed

    @property
    def num_batches(self):
        return self._num_batches


def _check_not_nested(ours) -> None:
    """TensorFlow cannot enter one strategy's scope inside another's ("Mixing different
    tf.distribute.Strategy objects"): say so in our words, with what works."""
    if not tf.distribute.has_strategy():
        return
    current = tf.distribute.get_strategy()
    if current is ours:
        return
    raise RuntimeError(
        f"acc.scope() (which acc.fit, evaluate and predict enter) was entered inside the "
        f"scope of another {type(current).__name__} "
        "(the user's own tf.distribute strategy), and TensorFlow cannot nest two strategies' "
        "scopes. Leave that scope first: build, compile and train the model in "
        "`with acc.scope():` alone, or use the other strategy without the Accelerator. Both "
        "can be used one after the other in one process; a model belongs to the strategy "
        "it was built under."
    )


def _optimizers(model) -> list:
    """`model.optimizer` and the optimizers a custom step keeps on the model (a GAN's)."""
    found = [getattr(model, "optimizer", None)]
    found += [v for v in vars(model).values() if isinstance(v, keras.optimizers.Optimizer)]
    unique = {id(o): o for o in found if o is not None}
    return list(unique.values())


def check_gradient_accumulation(optimizer, num_replicas: int) -> None:
    """Refuse Keras's gradient accumulation with several replicas on TensorFlow, before the
    first step, with what works instead.

    Keras's TF optimizer accumulates inside an `ops.cond` whose update branch merges the
    replicas (`merge_call`); TensorFlow refuses a merge_call inside a cond of a replicated
    step ("merge_call called while defining a new graph"), with raw MirroredStrategy too.
    """
    inner = inner_optimizer(optimizer)
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if num_replicas > 1 and steps:
        raise NotImplementedError(
            "Keras's gradient accumulation does not run under tf.distribute with more than "
            "one replica: its optimizer merges the replicas inside a cond, which TensorFlow "
            "refuses in a replicated step (raw MirroredStrategy fails the same way). "
            f"Received: {type(inner).__name__}(gradient_accumulation_steps={steps}) with "
            f"{num_replicas} replicas. Use KERAS_BACKEND=jax (accumulation works across "
            "replicas there), Accelerator(devices=1), or a global batch "
            f"{steps} times larger instead of accumulating."
        )


def _check_optimizers_built(model) -> None:
    """Optimizers of a custom step (a GAN's two) must be built before the first step under
    tf.distribute: built lazily inside a replicated step, their slots fail to initialize
    ("You must feed a value for placeholder tensor"). Keras builds `model.optimizer` only."""
    for name, value in vars(model).items():
        if (
            isinstance(value, keras.optimizers.Optimizer)
            and value is not getattr(model, "optimizer", None)
            and not value.built
        ):
            raise ValueError(
                f"{type(model).__name__}.{name} is not built: under tf.distribute an "
                "optimizer must be built before the first training step, and Keras builds "
                "only `model.optimizer`. Build it inside `acc.scope()` with the variables it "
                f"updates, e.g. `model.{name}.build(sub_model.trainable_variables)`, before "
                "acc.fit."
            )


_REDUCED: contextvars.ContextVar = contextvars.ContextVar("keras_accel_reduced", default=False)

# The class and module attributes below are shared by every call running in the process:
# replaced when the first call that needs them enters, given back when the last one leaves,
# under one lock, so that two calls in two threads never restore each other's wrappers. The
# replacements act only under a strategy of a running call (`_OURS`, by id, with a count);
# under any other (a plain model.fit in another thread, under the user's own strategy),
# Keras's own code runs, unchanged.
_LOCK = threading.Lock()
_SHARED: dict[str, list] = {}  # name -> [the Patches that installed it, calls using it]
_OURS: dict[int, int] = {}  # id(strategy) -> calls running under it


def share(patches: Patches, strategy, name: str, install) -> None:
    """`install(own_patches)` unless a running call did; undone (with `patches`) when the
    last call using it ends. `strategy` is this call's: the replacements act under it."""
    with _LOCK:
        entry = _SHARED.get(name)
        if entry is None:
            own = Patches()
            try:
                install(own)
            except BaseException:
                own.restore()
                raise
            entry = _SHARED[name] = [own, 0]
        entry[1] += 1
        _OURS[id(strategy)] = _OURS.get(id(strategy), 0) + 1

    def release() -> None:
        with _LOCK:
            left = _OURS.pop(id(strategy)) - 1
            if left:
                _OURS[id(strategy)] = left
            entry[1] -= 1
            if entry[1] == 0:
                del _SHARED[name]
                entry[0].restore()

    patches.add(release)


def _ours() -> bool:
    """Whether the strategy in scope is one a running call of ours registered."""
    return id(tf.distribute.get_strategy()) in _OURS


def _install_reduce_logs(patches: Patches) -> None:
    patches.set(keras_internals.tf_trainer_module(), "reduce_per_replica", _reduce_logs)


def install_global_batch_losses(patches: Patches, strategy) -> None:
    """Make every replica's loss the loss of its own rows, as on JAX and on one device, and
    average the gradients across replicas, under `strategy`, for the duration of `patches`.

    Keras on `tf.distribute` divides each replica's loss by the replica count (so that the
    gradients its optimizer sums across replicas add up to the global batch's), and divides
    it back only for the loss tracker of its built-in steps. A custom `train_step` that
    reports `compute_loss` as in Keras's guides therefore shows the loss divided by the
    replica count, on TF only. Here losses are not divided, and the optimizer averages the
    replicas' gradients instead of summing them: the same updates, and the same numbers on
    both backends for built-in and custom steps. The average is taken before gradient
    clipping and accumulation, so that `clipnorm` and `global_clipnorm` act on the global
    batch's gradient, as on JAX and on one device.
    """
    share(patches, strategy, "global_batch_losses", _install_global_batch_losses)


def _install_global_batch_losses(patches: Patches) -> None:
    losses = keras_internals.loss_module()

    def unscaled(original):
        def scale(value):
            return value if _ours() else original(value)

        return scale

    for name in ("scale_loss_for_distribution", "unscale_loss_for_distribution"):
        patches.set(losses, name, unscaled(getattr(losses, name)))
    optimizer_class = keras_internals.tf_optimizer_class()

    def averaging(original_apply):
        def apply(self, grads, trainable_variables=None):
            context = tf.distribute.get_replica_context()
            if (
                context is None
                or context.num_replicas_in_sync == 1
                or _REDUCED.get()
                or not _ours()
            ):
                return original_apply(self, grads, trainable_variables)
            grads = list(grads)
            present = [i for i, g in enumerate(grads) if g is not None]
            reduced = context.all_reduce(tf.distribute.ReduceOp.MEAN, [grads[i] for i in present])
            for i, g in zip(present, reduced):
                grads[i] = g
            token = _REDUCED.set(True)
            try:
                return original_apply(self, grads, trainable_variables)
            finally:
                _REDUCED.reset(token)

        return apply

    original_all_reduce = optimizer_class._all_reduce_sum_gradients

    def all_reduce_gradients(self, grads_and_vars):
        if not _ours():
            return original_all_reduce(self, grads_and_vars)
        grads_and_vars = list(grads_and_vars)
        if _REDUCED.get():
            return grads_and_vars  # Averaged in `apply` already.
        context = tf.distribute.get_replica_context()
        if context is None:
            return grads_and_vars
        present = [i for i, (g, _) in enumerate(grads_and_vars) if g is not None]
        reduced = context.all_reduce(
            tf.distribute.ReduceOp.MEAN, [grads_and_vars[i][0] for i in present]
        )
        for i, g in zip(present, reduced):
            grads_and_vars[i] = (g, grads_and_vars[i][1])
        return grads_and_vars

    patches.set(optimizer_class, "apply", averaging(optimizer_class.apply))
    # LossScaleOptimizer (float16) has an apply of its own, which checks the gradients for
    # overflow before its inner optimizer's: it must see the averaged ones too, so that every
    # replica takes the same decision (and no all-reduce runs inside its cond).
    loss_scale = keras.optimizers.LossScaleOptimizer
    patches.set(loss_scale, "apply", averaging(loss_scale.apply))
    patches.set(optimizer_class, "_all_reduce_sum_gradients", all_reduce_gradients)


def build(plan: Plan, layout_map=None) -> Runtime:
    if layout_map is not None:
        raise ValueError(
            "layout_map needs strategy='model_parallel' on the JAX backend. Received a "
            "layout_map with KERAS_BACKEND=tensorflow."
        )
    return Runtime(plan)


def backend_versions() -> dict[str, str]:
    return {"tensorflow": tf.__version__, "keras": keras.__version__}
