"""Every private name of a library other than Keras that keras_accel touches, listed in one
place, each with its reason and a check (the companion of `keras_internals`, which holds
Keras's).

Python's standard library, torch, TensorFlow, JAX and Grain each have a few places where no
public name does what keras_accel needs. `INTERNALS` lists them; the accessors below are
the only code that reads them (tests/utils/test_keras_internals_only.py reads the package's
source to hold it to that). Each accessor is one of two kinds, and `Internal.fallback` says
which:

- **required**: without the name keras_accel cannot do the job; the accessor raises
  `LibraryInternalsError`, naming the library, its version and the name;
- **optional**: the name only saves time or noise; without it the accessor takes the
  public path it names (same numbers, the same files), never an error.

`check(library)` verifies a library's entries against the installed version (the tests run
it for every library installed), so a release that renames one fails in CI, naming the
version, before a user meets the fallback.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any


class InternalsError(RuntimeError):
    """An internal that keras_accel relies on is missing from an installed library."""


class LibraryInternalsError(InternalsError):
    """A private name of Python, torch, TensorFlow, JAX or Grain that keras_accel relies on
    is missing from the installed version."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """`module.name` of `library`, needed for `why`; `fallback` is what happens without it
    (None: `LibraryInternalsError`)."""

    library: str
    module: str
    name: str
    why: str
    fallback: str | None = None


INTERNALS: list[Internal] = [
    Internal(
        "Python",
        "sys",
        "_current_frames",
        "the stacks of other threads: is an interrupted fit still running anywhere "
        "(BackupAndRestore's lock)? Documented in the sys module; no public name",
    ),
    Internal(
        "Python",
        "threading",
        "_register_atexit",
        "a hook that runs before threading shuts down concurrent.futures' pools, which "
        "Orbax writes through (Python >= 3.9)",
        fallback="atexit.register, too late for a save still being written",
    ),
    Internal(
        "Python",
        "os",
        "_exit",
        "ending a process at once after an uncaught error, without waiting for peers that "
        "will never arrive (documented in the os module)",
    ),
    Internal(
        "torch",
        "torch.Tensor",
        "_version",
        "the in-place version counter autograd checks: the only way to see that a gradient "
        "changed after the backward pass sent it",
    ),
    Internal(
        "torch",
        "torch.distributed.checkpoint.state_dict_saver",
        "_save_state_dict",
        "DCP's saver without the warning with which dcp.save says it saves in one process "
        "(in a background thread, no filter of ours can hold it back under -W error)",
        fallback="dcp.save, which warns",
    ),
    Internal(
        "torch",
        "torch.distributed.checkpoint._fsspec_filesystem",
        "FsspecWriter",
        "DCP checkpoints on remote file systems (gs://, s3://): not exported by "
        "torch.distributed.checkpoint, named as torch's own tests and torchtitan import it",
    ),
    Internal(
        "torch",
        "torch.distributed.checkpoint._fsspec_filesystem",
        "FsspecReader",
        "restoring DCP checkpoints from remote file systems (as FsspecWriter)",
    ),
    Internal(
        "TensorFlow",
        "tensorflow.python.data.experimental.ops.distribute",
        "_AutoShardDataset",
        "what tf.distribute applies to shard a pipeline by its files, so that each process "
        "reads only its own files",
        fallback="every process reads the whole pipeline and keeps its own rows",
    ),
    Internal(
        "TensorFlow",
        "tensorflow.python.data.experimental.ops.distribute",
        "compute_batch_size",
        "a pipeline's batch size read from its graph without reading data (what Keras's "
        "multi-process distribute_dataset uses)",
        fallback="one batch is read to see its size",
    ),
    Internal(
        "TensorFlow",
        "tensorflow.python.data.ops.multi_device_iterator_ops",
        "_create_device_dataset",
        "each device's data set of a tf.distribute iterator, made without tf.data's "
        "autotuning thread",
        fallback="the device data sets as TensorFlow makes them (a wait, never a number)",
    ),
    Internal(
        "TensorFlow",
        "tensorflow.python.eager.polymorphic_function.concrete_function:ConcreteFunction",
        "_call_flat",
        "calling a traced function with its flat tensor inputs: a group of steps on one "
        "device is one call, and the public call's signature handling took 0.2 ms of it "
        "(a small model's group of 32 steps runs in about 1 ms)",
        fallback="the public call with the same inputs (the same numbers, 0.2 ms a call more)",
    ),
    Internal(
        "JAX",
        "jax._src.distributed",
        "global_state",
        "the distributed runtime's key-value store (`global_state.client`), where the "
        "processes agree on the end of per-process data; JAX has no public accessor",
    ),
    Internal(
        "Grain",
        "grain BatchMapDataset / PrefetchIterDataset instances",
        "_batch_size, _drop_remainder, _batch_fn, _read_options",
        "how a Grain data set batches its parent, so that each process reads only its rows",
        fallback="every process reads the whole data set and keeps its own rows",
    ),
]


def _version(library: str) -> str:
    if library == "Python":
        return sys.version.split()[0]
    module = {"TensorFlow": "tensorflow", "JAX": "jax", "Grain": "grain"}.get(library, library)
    try:
        return str(importlib.import_module(module).__version__)
    except (ImportError, AttributeError):
        return "(version unknown)"


def _error(internal: Internal) -> LibraryInternalsError:
    return LibraryInternalsError(
        f"keras_accel relies on the {internal.library} internal `{internal.name}` of "
        f"{internal.module} ({internal.why}), which {internal.library} "
        f"{_version(internal.library)} does not have. Install the pinned versions with "
        '`pip install -c constraints.txt -e ".[all]"`, or report this version to keras_accel.'
    )


def _internal(name: str) -> Internal:
    return next(i for i in INTERNALS if i.name == name)


def _find(name: str) -> Any:
    """`module.name` (or `module:Class.name`) of the listed internal `name`, or
    `LibraryInternalsError`."""
    internal = _internal(name)
    module_name, _, class_name = internal.module.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        raise _error(internal) from None
    if class_name:
        owner = getattr(owner, class_name, None)
    if owner is None or not hasattr(owner, name):
        raise _error(internal)
    return getattr(owner, name)


def _find_optional(name: str) -> Any | None:
    """`module.name` of the listed optional internal `name`, or None."""
    try:
        return _find(name)
    except LibraryInternalsError:
        return None


def check(library: str) -> None:
    """Verify the module-level internals of `library` ("Python", "torch", "TensorFlow",
    "JAX"; Grain's are instance attributes, checked by `grain_batching` on a data set)
    against the installed version; raise `LibraryInternalsError` naming the first one
    missing and the version."""
    for internal in INTERNALS:
        if internal.library != library or internal.library == "Grain":
            continue
        if internal.module == "torch.Tensor":
            import torch

            if not hasattr(torch.zeros(1), internal.name):
                raise _error(internal)
            continue
        _find(internal.name)


# ---------------------------------------------------------------- Python


def current_frames() -> dict[int, Any]:
    """`sys._current_frames()`: each thread's topmost frame, by thread id."""
    return _find("_current_frames")()


def register_before_thread_pools_shutdown(function: Callable[[], None]) -> None:
    """Run `function` at exit before threading shuts down concurrent.futures' pools (later
    registrations run earlier); `atexit.register` where Python lacks the hook. Raises
    RuntimeError when the interpreter is already shutting down."""
    register = _find_optional("_register_atexit")
    (register or atexit.register)(function)


def exit_now(code: int) -> None:
    """`os._exit(code)`: end the process without cleanup handlers or waiting for threads."""
    _find("_exit")(code)


# ---------------------------------------------------------------- torch


def tensor_version(tensor) -> int:
    """A torch tensor's in-place version counter (`Tensor._version`): it grows with every
    in-place change, as autograd checks."""
    try:
        return tensor._version
    except AttributeError:
        raise _error(_internal("_version")) from None


def dcp_save_in_one_process(state: dict, writer) -> None:
    """`torch.distributed.checkpoint.save(state, storage_writer=writer, no_dist=True)`
    without its one-process UserWarning (DCP's own saver behind `dcp.save`)."""
    saver = _find_optional("_save_state_dict")
    if saver is None:  # pragma: no cover - a torch that moved it
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=writer, no_dist=True)
        return
    saver(state_dict=state, storage_writer=writer, no_dist=True)


def dcp_fsspec_writer(path: str):
    """DCP's storage writer for a remote (fsspec) path."""
    return _find("FsspecWriter")(path)


def dcp_fsspec_reader(path: str):
    """DCP's storage reader for a remote (fsspec) path."""
    return _find("FsspecReader")(path)


# ---------------------------------------------------------------- JAX


def jax_distributed_client():
    """The JAX distributed runtime's client (`jax._src.distributed.global_state.client`):
    None before `jax.distributed.initialize`."""
    state = _find("global_state")
    try:
        return state.client
    except AttributeError:
        raise _error(_internal("global_state")) from None


# ---------------------------------------------------------------- TensorFlow


def tf_call_concrete(concrete, inputs: list):
    """`concrete(*inputs)` for a concrete function whose inputs are exactly `inputs`, flat
    tensors in its signature's order, without the public call's signature handling."""
    if not _has_call_flat():
        return concrete(*inputs)
    return concrete._call_flat(inputs, concrete.captured_inputs)


@functools.lru_cache(maxsize=1)
def _has_call_flat() -> bool:
    return _find_optional("_call_flat") is not None


def tf_auto_shard_dataset() -> type:
    """TensorFlow's `_AutoShardDataset` (what `tf.distribute` applies to shard a pipeline by
    its files; no public name reaches it). Raises `LibraryInternalsError` where missing: the
    caller falls back to every process reading the whole pipeline."""
    return _find("_AutoShardDataset")


def tf_compute_batch_size(dataset) -> int | None:
    """The batch size of a tf.data pipeline's `batch` transformation, read from its graph
    without reading data; None where unknown (or this TensorFlow cannot tell)."""
    compute = _find_optional("compute_batch_size")
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
    if _find_optional("_create_device_dataset") is None:
        yield
        return
    import tensorflow as tf

    module = sys.modules[_internal("_create_device_dataset").module]
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


# ---------------------------------------------------------------- Grain


@dataclasses.dataclass(frozen=True)
class GrainBatching:
    """How a Grain `MapDataset.batch(...)` batches its parent (`grain_batching`)."""

    parent: Any  # The MapDataset whose elements are batched.
    batch_size: int
    drop_remainder: bool
    batch_fn: Callable | None
    read_options: Any  # `to_iter_dataset(read_options)`'s; None for a MapDataset.


def grain_batching(dataset) -> GrainBatching | None:
    """The batching of a Grain data set that is `parent.batch(n)` (a `MapDataset`), or that
    made into an `IterDataset` by `.to_iter_dataset()`; None for any other Grain data set.

    Grain's `BatchMapDataset` and `PrefetchIterDataset` keep their arguments private
    (`_batch_size`, `_drop_remainder`, `_batch_fn`, `_read_options`); their parents are
    public (`parents`). Checked against Grain 0.2.18. A Grain without them gives None (and
    every process reads the whole data set, as for any other stream), never an error.
    """
    read_options = None
    name = type(dataset).__name__
    if name == "PrefetchIterDataset":
        read_options = getattr(dataset, "_read_options", None)
        parents = getattr(dataset, "parents", ())
        if read_options is None or len(parents) != 1:
            return None
        dataset, name = parents[0], type(parents[0]).__name__
    if name != "BatchMapDataset" or not type(dataset).__module__.startswith("grain."):
        return None
    try:
        (parent,) = dataset.parents
        return GrainBatching(
            parent=parent,
            batch_size=int(dataset._batch_size),
            drop_remainder=bool(dataset._drop_remainder),
            batch_fn=dataset._batch_fn,
            read_options=read_options,
        )
    except (AttributeError, TypeError, ValueError):
        return None
