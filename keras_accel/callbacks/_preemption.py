"""Preemption: a SIGTERM (what a cloud sends before it takes a VM) becomes a last backup.

Every process of a run must save at the same step (a checkpoint is one collective write), but
each gets its SIGTERM at its own moment. `Watch.reached()`, called by every process at every
training-batch end, answers True on all of them at the same call once any was told:

- JAX with `jax.distributed`: the runtime's preemption sync point
  (`multihost_utils.reached_preemption_sync_point`, what Orbax's `reached_preemption` asks);
  JAX's distributed runtime catches SIGTERM itself, and agreeing costs nothing until one
  arrives;
- TensorFlow under a multi-worker strategy: a SIGTERM handler sets a flag, and the workers
  add their flags in one small all-reduce per call;
- torch with a process group: the same, the flags added in one small all-reduce of the
  process group per call (`keras_accel.adapter.backends.torch.agree_all`, on the thread that
  trains: the backup engine's background collectives use a group of their own);
- one process: a SIGTERM handler and its flag.

A handler installed here is removed when the watch closes (Python's own comes back). When
the fit ends by an exception Keras skips `on_train_end`, so nothing closes it: the handler
then finds the fit it belongs to gone from the stack, closes the watch and hands the signal
to the handler that was there before (by default, the process ends as SIGTERM ends it),
rather than swallowing it for the rest of the process.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import threading

from keras_accel.utils import process
from keras_accel.utils.printing import print_msg


class Preempted(SystemExit):
    """Raised out of `fit` after the preemption backup is on disk: the process then exits
    with code 143 (128 + SIGTERM), as a process stopped by SIGTERM does, so that a cluster
    manager restarts it, and the next run resumes from that backup."""

    code = 143

    def __init__(self, message: str):
        super().__init__(143)
        self.message = message

    def __str__(self) -> str:
        return self.message


def preempted(backup_dir: str, path: str | None) -> Preempted:
    """What ends a fit that SIGTERM reached, once its backup is on disk (printed too:
    SystemExit prints nothing of its own); `path` the backup saved, None when the last one
    is the one the run restored."""
    where = f"saved {path}" if path else "the last backup is the one this run restored"
    message = (
        f"BackupAndRestore: SIGTERM (preemption) reached every process; {where}. The next "
        f"run with backup_dir={backup_dir!r} resumes from it."
    )
    print_msg(message)
    return Preempted(message)


_calls = 0  # One count per process: the sync point needs ids that only grow.


class Watch:
    def __init__(self, model):
        import keras

        self.backend = keras.backend.backend()
        self._flag = threading.Event()
        self._previous = None
        self._reduce = None
        self._jax = False
        if self.backend == "jax" and process.num_processes() > 1:
            import jax

            self._jax = jax.distributed.is_initialized()
        # The frame of Keras's `fit` that is running this watch's callbacks (None when the
        # hooks are driven by hand, as a custom loop does). Held, not weakly referenced
        # (frames cannot be): the traceback of a fit that raised holds it anyway.
        self._fit_frame = None
        if not self._jax and threading.current_thread() is threading.main_thread():
            self._fit_frame = _fit_frame(model)
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        if self.backend == "tensorflow" and process.num_processes() > 1:
            self._reduce = _tf_any(model)
        if self.backend == "torch" and process.num_processes() > 1:
            self._reduce = _torch_any

    def _on_signal(self, signum, frame) -> None:
        if self._fit_frame is None or _on_stack(self._fit_frame, frame):
            self._flag.set()  # The next batch end saves a backup, then ends the fit.
            return
        # The fit this watch belongs to is over (it raised): the signal is not ours.
        previous = self._previous
        self.close()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL (or unknown): end as SIGTERM does.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def reached(self) -> bool:
        global _calls
        _calls += 1
        if self._jax:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(_calls))
        if self._reduce is not None:
            return self._reduce(self._flag.is_set())
        return self._flag.is_set()

    def close(self) -> None:
        self._fit_frame = None
        if self._previous is not None:
            with contextlib.suppress(ValueError):  # Not the main thread any more.
                if signal.getsignal(signal.SIGTERM) == self._on_signal:
                    signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _fit_frame(model):
    """The frame of `model.fit` (Keras's trainer) that is calling us now, if any."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
                return frame
            frame = frame.f_back
        return None
    finally:
        del frame


def _on_stack(target, frame) -> bool:
    """Whether `target` is `frame` or one of its callers: that call is still running."""
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


def _tf_any(model):
    """Whether any worker's flag is set: one all-reduce over the model's strategy."""
    import tensorflow as tf

    from keras_accel.utils import keras_internals

    strategy = keras_internals.distribute_strategy_of(model) or tf.distribute.get_strategy()

    @tf.function
    def total(flag):
        per_replica = strategy.run(lambda: tf.identity(flag))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def any_set(flag: bool) -> bool:
        return bool(total(tf.constant(1.0 if flag else 0.0)).numpy() > 0)

    return any_set


def _torch_any(flag: bool) -> bool:
    """Whether any process's flag is set: one all-reduce of the process group."""
    from keras_accel.adapter.backends.torch import agree_all

    return not agree_all(not flag)
