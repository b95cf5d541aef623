"""Which process am I? Process facts usable without an Accelerator (Accelerate's PartialState idea).

Files (checkpoints, histories, logs) are written by the chief process only; every writer in
keras_accel asks `is_chief()` here, so one rule decides for the whole package.
"""

from __future__ import annotations


def _tf_cluster():
    """The TF_CONFIG cluster this process belongs to (`keras_accel.adapter.cluster`, the one
    reader of TF_CONFIG), or None: one process, also under KERAS_ACCEL_DISTRIBUTED=0."""
    from keras_accel.adapter import cluster

    return None if cluster.switch() is False else cluster.detect_tf_config()


def _backend() -> str:
    import keras

    return keras.backend.backend()


def num_processes() -> int:
    """Number of cooperating training processes (1 for a single-process run)."""
    if _backend() == "jax":
        import jax

        return jax.process_count()
    found = _tf_cluster()
    return 1 if found is None else found.num_processes


def process_index() -> int:
    """Index of this process among `num_processes()`; 0 is the chief (workers come after
    a chief that TF_CONFIG names)."""
    if _backend() == "jax":
        import jax

        return jax.process_index()
    found = _tf_cluster()
    return 0 if found is None else found.process_id


def is_chief() -> bool:
    """True in the one process that writes files."""
    return process_index() == 0


def barrier(name: str, model=None) -> None:
    """Wait until every process got here (nothing to do in one process).

    Where one process prepares something that all then read (the chief creates a backup
    directory, the others list it), the others must not look before it is done. JAX: the
    distributed runtime's `sync_global_devices`; TensorFlow: one all-reduce over the
    model's multi-worker strategy.
    """
    if num_processes() == 1:
        return
    if _backend() == "jax":
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    import tensorflow as tf

    from keras_accel.utils import keras_internals

    strategy = (model is not None and keras_internals.distribute_strategy_of(model)) or None
    strategy = strategy or tf.distribute.get_strategy()
    if strategy not in _BARRIERS:  # Traced once: an eager collective costs a warning a call.

        @tf.function
        def meet():
            ones = strategy.run(lambda: tf.constant(1.0))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)

        _BARRIERS[strategy] = meet
    _BARRIERS[strategy]()


_BARRIERS: dict = {}
