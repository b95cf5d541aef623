"""The TPU: where one might be, connecting to it once per process, bounded in time, and
the `tpu` strategy on TensorFlow (`TPUStrategy`): its builder and its runtime, under
which Keras's trainer distributes the pipeline itself."""

from __future__ import annotations

import glob
import os
import threading

import tensorflow as tf

from keras_accel.adapter.backends.tensorflow.runtime import Runtime
from keras_accel.adapter.strategies import STRATEGIES, Plan

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


@STRATEGIES.builder("tpu", "tensorflow", default=True)
def _tpu(plan: Plan, layout_map):
    return tf.distribute.TPUStrategy(connect_tpu())


@STRATEGIES.runtime("tpu", "tensorflow", default=True)
class TPURuntime(Runtime):
    """A `TPUStrategy`: Keras's trainer distributes the pipelines it is given
    (`experimental_distribute_dataset`), which split each global batch over the cores."""

    @property
    def whole_remainder(self) -> str | None:
        """A short last batch is not run whole in every replica here (its program's shapes:
        not built): "whole" on one replica, else None."""
        return "whole" if self.num_replicas == 1 else None

    def fed(self, pipeline, batches, carry_mask: bool):
        return pipeline  # Keras distributes it.

    def keras_route(self, source, carry_mask: bool):
        return source  # Keras's own adapter, distributed by Keras.

    def distribute(self, pipeline, static_rows: int, own: bool = False):
        return self.native.experimental_distribute_dataset(pipeline)
