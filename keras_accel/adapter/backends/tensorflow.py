"""TensorFlow: `tf.distribute` strategies (OneDevice, Mirrored, TPU)."""

from __future__ import annotations

import contextlib
import glob
import os
import threading

import keras
import tensorflow as tf

from keras_accel.adapter.strategies import Plan
from keras_accel.data.pydataset import StaticBatchDataset
from keras_accel.data.sources import ArrayBatches

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


def _all_reduce_sum(tensors):
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensors
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


_MIRRORED: dict[tuple, tf.distribute.MirroredStrategy] = {}


def _mirrored(devices: tuple) -> tf.distribute.MirroredStrategy:
    # One strategy per device set and process: separate MirroredStrategy objects over the same
    # devices hand out clashing collective-op keys, and the second one's steps are cancelled
    # ("Function was cancelled before it was started") once both have run all-reduces.
    if devices not in _MIRRORED:
        _MIRRORED[devices] = tf.distribute.MirroredStrategy([_tf_name(d) for d in devices])
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
        else:
            self.native = _mirrored(tuple(plan.devices))
        # BatchNormalization sums its moments across replicas (see adapter.batchnorm).
        self.all_reduce_sum = _all_reduce_sum if self.num_replicas > 1 else None

    @contextlib.contextmanager
    def scope(self):
        if self.native is None:
            with tf.device(_tf_name(self.plan.devices[0])):
                yield
        else:
            with self.native.scope():
                yield

    def check_model(self, model) -> None:
        if self.native is None:
            return
        if getattr(model, "_distribute_strategy", None) is not self.native:
            raise RuntimeError(
                f"The model was built outside `acc.scope()`, so TensorFlow would train it on "
                f"one device, not with {type(self.native).__name__} over "
                f"{self.num_replicas} replicas. Build and compile it inside "
                "`with acc.scope():`."
            )

    def wrap(self, batches):
        if isinstance(batches, ArrayBatches):
            return array_dataset(batches)
        # A user's PyDataset: Keras's own route (tf.data from a generator).
        return StaticBatchDataset(batches)


def array_dataset(batches: ArrayBatches) -> tf.data.Dataset:
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
    n, rows, static = plan.num_samples, plan.batch_size, plan.static_rows
    with tf.device("/cpu:0"):
        leaves = tf.nest.map_structure(
            lambda a: None if a is None else tf.constant(a), _structure(batches)
        )
        epoch = tf.Variable(batches.epoch, dtype=tf.int64, trainable=False, name="epoch")
    batches.epoch_listeners.append(lambda value: epoch.assign(value))
    seed = tf.constant(batches.seed % 2**63, tf.int64)
    uniform = None if plan.training else plan.weight_scale(rows)

    def load(index):
        start = index * rows
        real = tf.minimum(n - start, rows)
        offsets = tf.range(static, dtype=tf.int64)
        positions = tf.minimum(start + offsets, n - 1)
        if batches.shuffle:
            positions = tf.random.experimental.index_shuffle(
                positions, seed=tf.stack([seed, epoch.read_value()]), max_index=n - 1
            )
        keep = offsets < real

        def take(leaf):
            gathered = tf.gather(leaf, positions)
            mask = tf.reshape(keep, [-1] + [1] * (leaf.shape.rank - 1))
            return tf.where(mask, gathered, tf.zeros_like(gathered))

        x, y, sample_weight = leaves
        if y is None:
            return (tf.nest.map_structure(take, x),)
        weights = tf.ones([static], tf.float32) if sample_weight is None else take(sample_weight)
        scale = (
            tf.cast(static, tf.float32) / tf.cast(real, tf.float32)
            if uniform is None
            else tf.constant(uniform, tf.float32)
        )
        weights = tf.where(keep, weights * scale, 0.0)
        return tf.nest.map_structure(take, x), tf.nest.map_structure(take, y), weights

    dataset = tf.data.Dataset.range(len(batches)).map(
        load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    options = tf.data.Options()
    # Batches come from in-memory rows, not files: shard by data across workers.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)


def _structure(batches: ArrayBatches):
    sample_weight = batches.sample_weight
    if sample_weight is not None:
        sample_weight = sample_weight.astype("float32")
    return batches.x, batches.y, sample_weight


def build(plan: Plan, layout_map=None) -> Runtime:
    if layout_map is not None:
        raise ValueError(
            "layout_map needs strategy='model_parallel' on the JAX backend. Received a "
            "layout_map with KERAS_BACKEND=tensorflow."
        )
    return Runtime(plan)


def backend_versions() -> dict[str, str]:
    return {"tensorflow": tf.__version__, "keras": keras.__version__}
