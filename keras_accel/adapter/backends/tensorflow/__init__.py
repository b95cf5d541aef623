"""TensorFlow: `tf.distribute` strategies (OneDevice, Mirrored, TPU, MultiWorkerMirrored).

One module per job:

- `runtime`: the base `Runtime`, one device or a MirroredStrategy (`single`,
  `data_parallel`, `mirrored`), and the distributed data sets it feeds;
- `strategies`: the builders of those names (and the refusals of the JAX-only ones);
- `multi_worker`: the `multi_worker` strategy, its builder and its runtime (each worker's
  rows of every batch, its own files);
- `tpu`: finding and connecting to a TPU, once per process, and the `tpu` strategy, its
  builder and its runtime (Keras distributes the pipeline);
- `cluster`: the process's MultiWorkerMirroredStrategy, and what workers agree on;
- `gradients`: the replicas' gradients summed before the optimizer clips them;
- `losses`: Keras's loss scaling made uniform, and the global batch's loss reported;
- `reduction`: sums, metrics' global results and multi-worker logs across replicas;
- `fused`: N steps in one `tf.function` (`steps_per_execution`);
- `xla`: where a call's steps run with XLA other than as the model was compiled;
- `checks`: what TensorFlow refuses under a strategy, refused first in our words.
"""

from __future__ import annotations

import keras
import tensorflow as tf

# Each strategy's module registers its builder and runtime class when imported.
from keras_accel.adapter.backends.tensorflow import multi_worker, strategies, tpu  # noqa: F401
from keras_accel.adapter.backends.tensorflow.cluster import agree_all, agree_seed, connect
from keras_accel.adapter.backends.tensorflow.runtime import Runtime
from keras_accel.adapter.backends.tensorflow.tpu import connect_tpu
from keras_accel.adapter.strategies import STRATEGIES, Plan, check_built

__all__ = [
    "Runtime",
    "agree_all",
    "agree_seed",
    "backend_versions",
    "build",
    "connect",
    "inventory",
]


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    found = {}
    if probe_tpu and connect_tpu() is not None:
        found["tpu"] = [f"tpu:{i}" for i in range(len(tf.config.list_logical_devices("TPU")))]
    for platform in ("GPU", "CPU"):
        devices = tf.config.list_logical_devices(platform)
        if devices:
            found[platform.lower()] = [f"{platform.lower()}:{i}" for i in range(len(devices))]
    return found


def build(plan: Plan, layout_map=None) -> Runtime:
    native = STRATEGIES.build(plan, "tensorflow", layout_map)
    runtime_class = STRATEGIES.runtime_class(plan.strategy, "tensorflow", Runtime)
    if isinstance(native, tf.distribute.Strategy):
        local = runtime_class.local_devices(native)
        check_built(plan, native, native.num_replicas_in_sync, local)
    elif native is not None:
        raise TypeError(
            f"On TensorFlow a strategy's builder returns a tf.distribute.Strategy or None. "
            f"Received: {type(native).__name__} from the builder of strategy={plan.strategy!r}"
        )
    return runtime_class(plan, native)


def backend_versions() -> dict[str, str]:
    return {"tensorflow": tf.__version__, "keras": keras.__version__}
