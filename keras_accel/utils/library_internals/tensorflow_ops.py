"""TensorFlow's own (not Keras's): tf.data's distribution ops (`_AutoShardDataset`,
`compute_batch_size`), the device data sets of a `MultiDeviceIterator`, a `tf.distribute`
iterator made when first read, a concrete function's flat call, and whether a strategy's
replicas reduce through `merge_call`."""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from keras_accel.utils.library_internals.lookup import Internal, find, find_optional

_AUTO_SHARD_DATASET = Internal(
    "TensorFlow",
    "tensorflow.python.data.experimental.ops.distribute",
    "_AutoShardDataset",
    "what tf.distribute applies to shard a pipeline by its files, so that each process "
    "reads only its own files",
    fallback="every process reads the whole pipeline and keeps its own rows",
)
_COMPUTE_BATCH_SIZE = Internal(
    "TensorFlow",
    "tensorflow.python.data.experimental.ops.distribute",
    "compute_batch_size",
    "a pipeline's batch size read from its graph without reading data (what Keras's "
    "multi-process distribute_dataset uses)",
    fallback="one batch is read to see its size",
)
_CREATE_DEVICE_DATASET = Internal(
    "TensorFlow",
    "tensorflow.python.data.ops.multi_device_iterator_ops",
    "_create_device_dataset",
    "each device's data set of a tf.distribute iterator, made without tf.data's autotuning thread",
    fallback="the device data sets as TensorFlow makes them (a wait, never a number)",
)
_CALL_FLAT = Internal(
    "TensorFlow",
    "tensorflow.python.eager.polymorphic_function.concrete_function:ConcreteFunction",
    "_call_flat",
    "calling a traced function with its flat tensor inputs: a group of steps on one "
    "device is one call, and the public call's signature handling took 0.2 ms of it "
    "(a small model's group of 32 steps runs in about 1 ms)",
    fallback="the public call with the same inputs (the same numbers, 0.2 ms a call more)",
)
_DISTRIBUTED_ITERATOR = Internal(
    "TensorFlow",
    "tensorflow.python.distribute.input_lib",
    "DistributedIterator",
    "a tf.distribute iterator whose methods read its state from its attributes: one made "
    "when first read is an instance of its class that makes the real one then and reads "
    "that one's attributes",
    fallback="each iterator is made when asked for, read or not (on 8 CPU replicas about "
    "0.5 s each)",
)
_SUPPORTS_NO_MERGE_CALL = Internal(
    "TensorFlow",
    "tensorflow.python.distribute.merge_call_interim",
    "strategy_supports_no_merge_call",
    "whether the current strategy's replicas reduce through merge_call (TensorFlow exports it "
    "as tf.__internal__.distribute.strategy_supports_no_merge_call; Keras's optimizers use "
    "it): there a sum nothing differentiates is reduced without tf.custom_gradient, whose "
    "gradient function keeps each traced step's graphs alive for the process's life",
    fallback="every reduction goes through ReplicaContext.all_reduce (the same numbers; each "
    "traced step's graphs stay in memory, and every full garbage collection walks them)",
)
INTERNALS = [
    _AUTO_SHARD_DATASET,
    _COMPUTE_BATCH_SIZE,
    _CREATE_DEVICE_DATASET,
    _DISTRIBUTED_ITERATOR,
    _CALL_FLAT,
    _SUPPORTS_NO_MERGE_CALL,
]


def tf_call_concrete(concrete, inputs: list):
    """`concrete(*inputs)` for a concrete function whose inputs are exactly `inputs`, flat
    tensors in its signature's order, without the public call's signature handling."""
    if not _has_call_flat():
        return concrete(*inputs)
    return concrete._call_flat(inputs, concrete.captured_inputs)


@functools.lru_cache(maxsize=1)
def _has_call_flat() -> bool:
    return find_optional(_CALL_FLAT) is not None


def tf_replicas_merge_to_reduce() -> bool:
    """Whether the current `tf.distribute` strategy's replicas reduce through
    `ReplicaContext.merge_call` (every strategy, except MirroredStrategy or multi-worker
    under XLA with only GPUs); False where this TensorFlow cannot tell."""
    supports_no_merge_call = _supports_no_merge_call()
    return supports_no_merge_call is not None and not supports_no_merge_call()


# Looked up once: called while a step traces, where AutoGraph would convert the lookup (and warn
# that it cannot convert `importlib`'s), but runs a cached function as it is.
@functools.lru_cache(maxsize=1)
def _supports_no_merge_call() -> Callable[[], bool] | None:
    return find_optional(_SUPPORTS_NO_MERGE_CALL)


def tf_auto_shard_dataset() -> type:
    """TensorFlow's `_AutoShardDataset` (what `tf.distribute` applies to shard a pipeline by
    its files; no public name reaches it). Raises `LibraryInternalsError` where missing: the
    caller falls back to every process reading the whole pipeline."""
    return find(_AUTO_SHARD_DATASET)


def tf_compute_batch_size(dataset) -> int | None:
    """The batch size of a tf.data pipeline's `batch` transformation, read from its graph
    without reading data; None where unknown (or this TensorFlow cannot tell)."""
    compute = find_optional(_COMPUTE_BATCH_SIZE)
    if compute is None:
        return None
    try:
        size = int(compute(dataset))
    except Exception:  # Not a pipeline this TensorFlow can analyse.
        return None
    return size if size > 0 else None


_DEVICE_DATASETS_LOCK = threading.RLock()


@contextlib.contextmanager
def tf_device_datasets_without_autotune():
    """While open, each device's data set of a `tf.distribute` iterator made on any thread
    runs without tf.data's autotuning thread (`keras_accel.adapter.backends.tensorflow.
    runtime.Distributed` says why); everything else about them is TensorFlow's.

    TensorFlow's `MultiDeviceIterator` builds them in `multi_device_iterator_ops.
    _create_device_dataset` (a generator over the host iterator and a prefetch, with default
    options). A TensorFlow without it leaves them as they are: it costs the wait, it changes
    no number. The module's name is restored on the way out."""
    if find_optional(_CREATE_DEVICE_DATASET) is None:
        yield
        return
    import tensorflow as tf

    module = sys.modules[_CREATE_DEVICE_DATASET.module]
    options = tf.data.Options()
    options.autotune.enabled = False
    # One thread at a time, and the original read under the lock: a thread that read it
    # while another's replacement was in place would put that replacement back for good.
    with _DEVICE_DATASETS_LOCK:
        original = module._create_device_dataset

        def without_autotune(*args, **kwargs):
            return original(*args, **kwargs).with_options(options)

        module._create_device_dataset = without_autotune
        try:
            yield
        finally:
            module._create_device_dataset = original


def tf_iterator_made_when_read(make: Callable[[], Any], kind: type) -> Any:
    """An iterator that is `make()`'s, made the first time anything reads it (a step function
    it is passed to, `next`, `get_next`), not now; `make()` itself where that cannot be done
    safely. `kind` is the class of the iterators `make` makes: the new one is of that class,
    so Keras's `isinstance` tests and `tf.function`'s signature (the type spec, read from the
    real iterator) see what they would have seen.

    Only TensorFlow's own `DistributedIterator` class is imitated (its methods keep their
    state in the instance's attributes, which the imitation reads from the real iterator,
    and set none after `__init__`); any other class, or a TensorFlow without it, gets
    `make()`."""
    base = find_optional(_DISTRIBUTED_ITERATOR)
    if base is None or kind is not base:
        return make()
    return _made_when_read(base)(make)


@functools.cache
def _made_when_read(base: type) -> type:
    """`base`'s subclass whose instances are made when first read (one class per base)."""

    class MadeWhenRead(base):
        """`base`'s iterator, made at the first read of an attribute it does not have."""

        # No `base.__init__`: its attributes are the real iterator's, read through
        # `__getattr__` (called only for what the instance lacks).
        def __init__(self, make):
            self.__dict__["keras_accel_make"] = make

        def __getattr__(self, name):
            if name.startswith("__") or name.startswith("keras_accel"):
                raise AttributeError(name)  # Copying, pickling, debuggers: nothing made.
            state = self.__dict__
            if "keras_accel_real" not in state:  # Its `make` kept until it made one.
                state["keras_accel_real"] = state["keras_accel_make"]()
                del state["keras_accel_make"]
            return getattr(state["keras_accel_real"], name)

    MadeWhenRead.__qualname__ = MadeWhenRead.__name__ = f"{base.__name__}MadeWhenRead"
    return MadeWhenRead
