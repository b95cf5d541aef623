"""The TPU: where one might be, and connecting to it once per process, bounded in time."""

from __future__ import annotations

import glob
import os
import threading

import tensorflow as tf

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
