"""A TF_CONFIG cluster: the one MultiWorkerMirroredStrategy of the process, made before
TensorFlow's first op, and what the workers agree on through it."""

from __future__ import annotations

import os

import tensorflow as tf

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


def multi_worker() -> tf.distribute.MultiWorkerMirroredStrategy | None:
    """The process's MultiWorkerMirroredStrategy (`connect` made it), or None."""
    return _multi_worker
