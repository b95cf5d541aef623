"""Which process am I? Process facts usable without an Accelerator (Accelerate's PartialState idea).

Files (checkpoints, histories, logs) are written by the chief process only; every writer in
keras_accel asks `is_chief()` here, so one rule decides for the whole package.
"""

from __future__ import annotations

import contextlib
import itertools


def _tf_cluster():
    """The TF_CONFIG cluster this process belongs to (`keras_accel.utils.cluster`, the one
    reader of TF_CONFIG), or None: one process, also under KERAS_ACCEL_DISTRIBUTED=0."""
    from keras_accel.utils import cluster

    return None if cluster.switch() is False else cluster.detect_tf_config()


def _backend() -> str:
    import keras

    return keras.backend.backend()


def _torch_group():
    """torch.distributed, where this process joined a process group (the Accelerator's
    `connect`, or the user's own `init_process_group`), else None. Only looked up where
    torch is imported already: asking never imports it."""
    import sys

    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def num_processes() -> int:
    """Number of cooperating training processes (1 for a single-process run)."""
    if _backend() == "jax":
        import jax

        return jax.process_count()
    if _backend() == "torch":
        group = _torch_group()
        return 1 if group is None else group.get_world_size()
    found = _tf_cluster()
    return 1 if found is None else found.num_processes


def process_index() -> int:
    """Index of this process among `num_processes()`; 0 is the chief (workers come after
    a chief that TF_CONFIG names)."""
    if _backend() == "jax":
        import jax

        return jax.process_index()
    if _backend() == "torch":
        group = _torch_group()
        return 0 if group is None else group.get_rank()
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
    model's multi-worker strategy; torch: a barrier of the process group that fails after
    its timeout, naming the processes that never came.
    """
    if num_processes() == 1:
        return
    if _backend() == "jax":
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    if _backend() == "torch":
        _torch_barrier(name)
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


def _torch_barrier(name: str) -> None:
    """gloo: a barrier that names the ranks that never came, after the heartbeat timeout
    (`KERAS_ACCEL_HEARTBEAT_TIMEOUT`, 100 s); other process groups: theirs."""
    import datetime
    import os

    import torch.distributed as dist

    if dist.get_backend() != "gloo":
        dist.barrier()
        return
    seconds = int(os.environ.get("KERAS_ACCEL_HEARTBEAT_TIMEOUT", "100"))
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as error:
        raise RuntimeError(f"keras_accel: barrier {name!r}: {error}") from error


def coordination_client():
    """The JAX distributed runtime's client (its key-value store on the coordinator), or a
    clear error. `jax.distributed.initialize` makes it; JAX has no public accessor."""
    from keras_accel.utils import library_internals

    client = library_internals.jax_distributed_client()
    if client is None:
        raise RuntimeError(
            "Several JAX processes but no distributed runtime client: call "
            "jax.distributed.initialize (or create the Accelerator) before reading data."
        )
    return client


# The passes this process has made over per-process data, numbered from 1 (`EndAgreement`).
_PASS_NUMBERS = itertools.count(1)


class EndAgreement:
    """Where one pass over per-process data ends, agreed by every process, without counting.

    Each process reads its own part of the data (its files), so the processes run out after
    different numbers of batches, and a training step needs every process. Every process
    publishes how many batches it has read (one write to the coordinator per batch) and, at
    its end, how many it had. A process whose data ended keeps feeding padding batches (row
    mask 0: they weigh nothing) as long as another process still has a batch for that step,
    and stops when every process has ended: all stop after the same step, the longest
    process's last. Only a process that ran out ever waits, and only for the others to
    reach the step it is at; a process with data never waits.

    Passes are numbered in the order every process makes them (each epoch's, each
    evaluation's), which is the same program order in every process.
    """

    POLL_S = 0.001
    TIMEOUT_S = 600.0  # A process that never comes is a dead process: fail, do not hang.

    def __init__(self):
        self.number = next(_PASS_NUMBERS)
        self.me = process_index()
        self.others = [p for p in range(num_processes()) if p != self.me]
        self._client = coordination_client()
        self._ended: dict[int, int] = {}
        # Every process finished pass n - 2 before any began pass n (the end of pass n - 1
        # needed all of them): its keys are read by no one any more.
        for kind in ("have", "end"):
            # Never written (the pass had no data here), or already gone: nothing to delete.
            with contextlib.suppress(Exception):
                self._client.key_value_delete(self._key(kind, self.me, self.number - 2))

    def _key(self, kind: str, process: int, number: int | None = None) -> str:
        number = self.number if number is None else number
        return f"keras_accel/ends/{number}/{kind}/{process}"

    def have(self, batches: int) -> None:
        """This process has read `batches` batches of the pass."""
        self._client.key_value_set(self._key("have", self.me), str(batches), True)

    def more(self, step: int) -> bool:
        """This process's data ended before `step` (0-based): does any other process have a
        batch for it? Waits until each other process has either read that far or ended."""
        import time

        if self.me not in self._ended:  # The first step past this process's data.
            self._ended[self.me] = step
            self._client.key_value_set(self._key("end", self.me), str(step), True)
        deadline = time.monotonic() + self.TIMEOUT_S
        for other in self.others:
            while other not in self._ended:
                if self._read("have", other) > step:
                    return True
                end = self._read("end", other)
                if end >= 0:
                    self._ended[other] = end
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Process {self.me} waited {self.TIMEOUT_S:.0f} s for process {other} "
                        f"to reach step {step} of a pass over per-process data (pass "
                        f"{self.number}): it neither read that batch nor said its data ended."
                    )
                time.sleep(self.POLL_S)
        return any(end > step for end in self._ended.values())

    def _read(self, kind: str, process: int) -> int:
        try:
            return int(self._client.key_value_try_get(self._key(kind, process)))
        except Exception as error:  # jaxlib's runtime error: its status is in the text.
            if "NOT_FOUND" not in str(error):
                raise  # The coordinator is gone or refused: not "not written yet".
            return -1  # Not written yet.


class StoreUnanswered(RuntimeError):
    """The port of torch's process-group store accepted a connection but never answered."""


def torch_store(host: str, port: int, rank: int, world_size: int, timeout_s: float, source: str):
    """torch's process-group store at `host:port`, as `init_process_group`'s `tcp://` would
    make it (rank 0 serves it; the others connect), for `init_process_group(store=...)`.

    torch bounds a connection that is refused (rank 0 not up yet: retried until the
    timeout), but not one that is accepted and never answered: where another program holds
    MASTER_PORT, every rank but 0 waits for ever for the store's reply (torch's own
    `init_process_group` too). So the store is made in a thread, and a rank that has no
    store after the timeout (and a little more, for a refusal's own error to come first)
    fails, naming the port; the thread, blocked in torch's C++ without the GIL, is left to
    the process's end.
    """
    import datetime
    import threading

    import torch.distributed as dist

    made: dict = {}

    def make():
        try:
            made["store"] = dist.TCPStore(
                host,
                port,
                world_size,
                rank == 0,
                timeout=datetime.timedelta(seconds=timeout_s),
                multi_tenant=True,
            )
        except BaseException as error:  # Handed to the caller's thread, which raises it.
            made["error"] = error

    thread = threading.Thread(target=make, name="keras_accel-torch-store", daemon=True)
    thread.start()
    thread.join(timeout_s + STORE_MARGIN_S)
    if thread.is_alive() and not _accepts(host, port):
        # Nothing listens there: torch is retrying a refused connection on a loaded machine,
        # and its own error (rank 0 never came) is the one to give.
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"torch's store at {host}:{port} timed out: nothing listens")
    if "error" in made:
        raise made["error"]
    if "store" in made:
        return made["store"]
    waited = timeout_s + STORE_MARGIN_S
    raise StoreUnanswered(
        f"Process {rank} of {world_size} connected to {host}:{port} ({source}) but got no "
        f"answer from torch's process-group store there in {waited:g} s: another program "
        f"holds MASTER_PORT={port}. Choose a free MASTER_PORT (the same for every rank), or "
        "let `keras-accel launch` pick one; KERAS_ACCEL_HEARTBEAT_TIMEOUT sets how long this "
        "waits."
    )


# A refused connection's own error comes at the timeout; this is how much later a silent
# one is named instead.
STORE_MARGIN_S = 5.0


def _accepts(host: str, port: int) -> bool:
    """Does something accept TCP connections at `host:port` now?"""
    import socket

    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False
