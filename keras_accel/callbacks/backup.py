"""`BackupAndRestore`: the full training state, on Orbax (JAX), tf.train (TensorFlow) or
torch.distributed.checkpoint (torch), keyed by variable path, saved asynchronously and
rotated, resumed exactly."""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import sys
import tempfile
import time
import warnings
import weakref

import keras

from keras_accel.adapter.protocol import run_context
from keras_accel.callbacks import _faults
from keras_accel.callbacks._lock import LOCK_NAME, DirectoryLock
from keras_accel.callbacks._preemption import Preempted, Watch
from keras_accel.callbacks.history import History
from keras_accel.callbacks.learning_rate import optimizer_rate
from keras_accel.state import checksums, engines, files, tree
from keras_accel.utils import keras_internals, library_internals, process
from keras_accel.utils.checks import check_positive_int
from keras_accel.utils.printing import print_msg

FORMAT = "keras_accel.BackupAndRestore"
# 3: the states of the fit's callbacks under "callbacks" ({state key: state_dict()}); version
# 2 kept the History record alone, under "history" (still restored).
VERSION = 3
# What `keras.callbacks.BackupAndRestore` writes into its backup_dir: the weights (with the
# optimizer's variables) and {"epoch": ..., "batch": ...}, and with double_checkpoint=True the
# previous pair as .bkp copies.
KERAS_WEIGHTS = "latest.weights.h5"
KERAS_METADATA = "training_metadata.json"
KERAS_FILES = (KERAS_WEIGHTS, KERAS_METADATA, f"{KERAS_WEIGHTS}.bkp", f"{KERAS_METADATA}.bkp")
# The engine each backup_dir of this process was opened with.
_OPEN: dict[str, object] = {}
# The step each backup_dir of this process is writing in the background, until it is on disk.
_WRITING: dict[str, int] = {}
# The callback each backup_dir of this process was last trained with (weakly): the next fit
# on that directory lets go of a fit an exception ended (`_abandon`).
_RUNNING: dict[str, weakref.ref] = {}
_AT_EXIT = False


def _finish_saves_at_exit() -> None:
    """At interpreter exit, every background save of this process reaches the disk.

    A `fit` that an exception ends (a crash, a KeyboardInterrupt) skips `on_train_end`, the
    callback's wait, and the interpreter then exits with the last backup still being written.
    tf.train's asynchronous save joins its thread at exit; Orbax's is stopped half-way (its
    writer needs thread pools that Python shuts down first), and the next run would silently
    start from the backup before, or from scratch. A killed process still loses the save in
    flight; the next run then says so (`_warn_interrupted`).
    """
    for directory, engine in list(_OPEN.items()):
        try:
            engine.wait()
        except Exception as error:  # Exiting anyway: say what was lost.
            print(_write_error(directory, _WRITING.get(directory), error, engine), file=sys.stderr)
        _WRITING.pop(directory, None)


def _wait_at_exit() -> None:
    global _AT_EXIT
    if _AT_EXIT or process.num_processes() > 1:
        # Across processes a save ends with a barrier of all of them: a process leaving on
        # an error must not wait for peers (utils/cluster.py ends it at once).
        return
    _AT_EXIT = True
    # Before threading's own exit hooks, which shut down concurrent.futures' pools (Orbax
    # writes through them); registered later, it runs earlier. atexit runs too late.
    with contextlib.suppress(RuntimeError):  # Raised when already shutting down.
        library_internals.register_before_thread_pools_shutdown(_finish_saves_at_exit)


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state, and resumes an interrupted `fit` exactly.

    A drop-in for `keras.callbacks.BackupAndRestore(backup_dir, save_freq="epoch",
    double_checkpoint=False, delete_checkpoint=True)`: run the same `fit` again after a
    crash and it continues from the last backup instead of epoch 0. It adds:

    - **the engines the field uses**: on JAX the arrays go to Orbax, written where they live
      (sharded arrays by the processes that hold them, never gathered to one host); on
      TensorFlow to `tf.train.Checkpoint` with `tf.train.CheckpointManager` (as the first
      seed does), which saves a mirrored variable once and writes `gs://` from a TPU host;
      on torch to `torch.distributed.checkpoint` (DCP), which spreads the writes of the
      replicated state over the processes and restores onto any number of processes.
      All save in the background by default: training goes on while the data is written,
      and the callback waits for the last save at the end of `fit` and before a restore.
    - **keyed by variable path**: state is saved and restored by Keras's variable paths, not
      by order. A checkpoint in which a model or optimizer variable is missing, extra or of
      another shape is refused with an error naming them (`partial_restore=True` restores
      the ones that match instead, with a warning naming the others).
    - **the full state**: weights and non-trainable variables (BatchNormalization
      statistics, Dropout's seed-generator states), optimizer variables (slots, iteration
      count, learning rate, hence the position of a `LearningRateScheduler`), the running
      metric totals; and, in one small JSON record the engine commits with the arrays, what
      no engine stores: epoch and batch, the state of every callback of the fit that has
      `state_dict()`/`load_state_dict(state)` methods (the `keras_accel.callbacks.History`
      record; your own callbacks' too, see below), the Python and NumPy random generator
      states, the variable manifest, the versions.
    - **mid-epoch resume**: with `save_freq=N` (steps) a backup can fall inside an epoch.
      Keras cannot start an epoch part-way, so the resumed run re-runs that epoch's first
      batches and, when it reaches the backup's position, restores the state again: their
      effect is overwritten, and training continues bit-for-bit as the uninterrupted run
      would (given a data order that depends only on the epoch, as `Accelerator.fit`
      guarantees). Other keras_accel callbacks ignore the re-run batches, and yours can
      (`run_context(model).replaying(epoch, batch)`).
    - **rotation and atomic commits** by the engine: the newest `max_to_keep` backups are
      kept (default 5, as the seed's `CheckpointManager`), one per training step; a backup
      that a crash interrupted is never listed.
    - **verified**: every backup commits with each file's size and CRC32C
      (`keras_accel.state.checksums`; tf.train keeps its own), checked before a restore. A
      damaged newest backup is named in a warning (step, file, what differs), set aside
      under `backup_dir/damaged/` and the newest intact one restored; none intact is an
      error naming each. A backup that cannot be written stops training naming the
      directory, the step, the cause and the newest intact backup, and leaves nothing of
      itself behind.
    - **one run per directory**: a lock file makes a second run pointed at the same
      directory fail with a clear error while the first is alive.
    - **chief-coordinated**: every process hands its state to the engine (which writes each
      process's share) and takes part in deleting the backups at the end; only the chief
      locks.
    - **a notebook's day**: a fit stopped by Ctrl-C or an error lets go of the directory
      (at once under `Accelerator.fit`; under `model.fit` when the next fit on it starts in
      this process), and a model built again in the same session, whose layers Keras names
      `dense_2` where the backup has `dense`, restores: paths that differ only in Keras's
      automatic numbering pair up in order.
    - **Keras's backups**: a `backup_dir` written by `keras.callbacks.BackupAndRestore`
      (`latest.weights.h5`, `training_metadata.json`, their `.bkp` copies) is resumed from,
      with a warning: its weights, optimizer state and epoch, from the start of that epoch
      as Keras would. The next backup replaces its files. Both kinds in one directory are
      an error naming them. Keras's `_current_epoch`, `_last_batch_seen`, `_weights_path`
      and `_training_metadata_path` (and `_prev_` ones) exist here too, the paths naming
      the newest (and second newest) complete backup's files, None before there is one.

    **Your callbacks' state**: a callback of the same `fit` (any position in the list) that
    defines `state_dict()`, returning JSON-able data (dicts, lists, strings, numbers, bool,
    None), and `load_state_dict(state)` is saved with every backup and given its state back
    on resume, in this callback's `on_train_begin`, before the first epoch begins (a
    callback listed after this one then sees its `on_train_begin` after the load: keep
    state there that a resume must not reset). States are keyed by the callback's
    `state_key` attribute where it has one, else its class name; two with one key in a fit
    are an error. A state in the backup that no callback of this fit claims is left unused.
    (Lightning's `Callback.state_dict`; `keras_accel.adapter.protocol`.) Outside a `fit`'s
    callback list (a custom loop driving the hooks itself) only `model.history` is saved.

    The callback does not need `fit`: a custom loop can call `set_model`, `set_params`
    (`{"epochs": ..., "steps": ...}`) and the `on_*` hooks, or `save(epoch, batch)`,
    `wait()` and `restore()` directly.

    Args:
        backup_dir: directory for the backups: a local path, or a URL (`gs://`, `s3://`:
            any scheme fsspec has, on every backend; Orbax and tf.train write `gs://`
            themselves and stage other schemes on the local disk, uploading each backup
            with a commit marker; docs/callbacks.md, "Object stores"). Every process must
            see the same directory. It must not be shared with other runs or other callbacks.
        save_freq: "epoch" (after every epoch), an integer N (every N training batches,
            counted across epochs), or False (never automatically; call `save`).
        double_checkpoint: accepted for Keras compatibility; keeping at least 2 backups
            is what it asks for, and `max_to_keep` (>= 2 then) already does it.
        delete_checkpoint: delete the backups when training ends normally.
        max_to_keep: how many backups to keep, >= 1.
        lock_timeout: seconds after which the lock of a run on another host that stopped
            refreshing it is considered stale; None never takes such a lock over. On the
            same host a lock is stale as soon as its process is gone.
        verbose: 1 prints a line for every save and restore.
        save_on_background: write in the background (Keras's `OrbaxCheckpoint` name);
            False waits for every save to be on disk before training goes on.
        partial_restore: restore the variables that match and keep the others, instead of
            refusing a checkpoint that does not fit the model.

    Example:

    >>> import keras, numpy as np, tempfile
    >>> from keras_accel.callbacks import BackupAndRestore
    >>> class Interrupt(keras.callbacks.Callback):
    ...     def on_epoch_begin(self, epoch, logs=None):
    ...         if epoch == 2:
    ...             raise RuntimeError("interrupted")
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> x, y = np.ones((8, 2)), np.ones((8, 1))
    >>> backup = BackupAndRestore(tempfile.mkdtemp())
    >>> try:
    ...     model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, Interrupt()])
    ... except RuntimeError:
    ...     pass
    >>> history = model.fit(x, y, epochs=4, verbose=0, callbacks=[backup])
    >>> history.epoch  # Epochs 0 and 1 were done before the interruption.
    [2, 3]
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int | bool = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        max_to_keep: int = 5,
        lock_timeout: float | None = 600.0,
        verbose: int = 0,
        save_on_background: bool = True,
        partial_restore: bool = False,
    ):
        # The Keras internals our callbacks rely on, checked once, under a plain model.fit too.
        keras_internals.check()
        super().__init__()
        # Keras's wording first (code may match it), then what would work.
        if not backup_dir:
            raise ValueError(
                f"Empty `backup_dir` argument passed. Received: backup_dir={backup_dir!r}. "
                "Pass the directory (a path or a URL) to keep the backups in."
            )
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise ValueError(
                "`backup_dir` must be a path or URL string. "
                f"Received: backup_dir={backup_dir!r} of type {type(backup_dir).__name__}"
            )
        if not (
            save_freq == "epoch"
            or save_freq is False
            or (isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0)
        ):
            raise ValueError(
                "Invalid value for argument `save_freq`. "
                f"Received: save_freq={save_freq!r}. "
                "Expected either 'epoch' or an integer value: a positive number of batches "
                "(or False, to save only when `save()` is called)."
            )
        max_to_keep = check_positive_int("max_to_keep", max_to_keep)
        if lock_timeout is not None and not lock_timeout > 0:
            raise ValueError(
                "`lock_timeout` must be a positive number of seconds, or None. "
                f"Received: lock_timeout={lock_timeout!r}"
            )
        backup_dir = os.fspath(backup_dir)
        if not files.is_remote(backup_dir):
            backup_dir = os.path.abspath(backup_dir.removeprefix("file://"))
        self._engine_module = engines.engine_module(keras.backend.backend())
        if not self._engine_module.supports(backup_dir):
            raise ValueError(
                f"BackupAndRestore stores training state through "
                f"{self._engine_module.NAME}, which cannot write {backup_dir!r}: it writes "
                f"{self._engine_module.WRITES}. Received: backup_dir={backup_dir!r}. Use a local "
                "directory or a URL whose fsspec package is installed (s3:// needs "
                "`pip install s3fs`)."
            )
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max(max_to_keep, 2) if double_checkpoint else max_to_keep
        self.lock_timeout = lock_timeout
        self.verbose = verbose
        self.save_on_background = bool(save_on_background)
        self.partial_restore = bool(partial_restore)
        self._engine = None
        self._lock = DirectoryLock(backup_dir, lock_timeout, self, self._in_fit)
        self._training = False
        # Keras's names and meaning (code and Keras's tests read them): the epoch in progress
        # (after an epoch ends: the number of epochs done), and the index of the last training
        # batch of this epoch (0 at the start of each epoch).
        self._current_epoch = 0
        self._last_batch_seen = 0
        self._steps_done = 0  # Training batches done, counted across epochs.
        self._last_saved = 0
        self._save_at_epoch_end = False
        self._last_batch, self._batch_epoch = -1, None  # To count batches across epochs.
        self._replay: dict | None = None  # The state to assign again at the replay's end.
        self._watch: Watch | None = None  # SIGTERM -> a last backup (`_preemption`).
        self._preempted = False
        self._sets_initial_epoch = False  # A restore set `model._initial_epoch` for Keras.
        self._fit_callbacks: list | None = None  # The other callbacks of the fit in progress.
        # The fit's keras.callbacks.CallbackList, weakly (None: hooks called directly), to
        # tell a fit that is running from one that an exception or Ctrl-C ended.
        self._calls: weakref.ref | None = None

    # ------------------------------------------------------------------ hooks
    def set_model(self, model):
        # The Keras internals read on the model and its optimizer: checked before any step.
        keras_internals.check_model(model)
        super().set_model(model)

    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            # Keras's message, word for word: restoring needs the variables to exist.
            raise ValueError(
                "To use the BackupAndRestore callback, "
                "you model must be built before you call `fit()`. "
                f"Model {model} is unbuilt. You can build it "
                "beforehand by calling it on a batch of data. (Or start it with a "
                "`keras.Input(shape)`, or call `model.build(input_shape)`.)"
            )
        self._training = True
        self._current_epoch = 0
        self._last_batch_seen = 0
        self._steps_done = 0
        self._last_saved = 0
        self._save_at_epoch_end = False
        self._last_batch, self._batch_epoch = -1, None
        # A fit interrupted during a mid-epoch replay leaves it pending: this fit starts anew.
        self._replay = None
        context = run_context(model)
        context.replay_epoch = None
        context.resumed_at = None  # A restore below sets it again; an earlier fit's is gone.
        # The others only, and weakly: a reference to itself would make a cycle, and strong
        # ones would keep a failed fit's callbacks (and their models) alive while this one is.
        calls = keras_internals.calling_callback_list(self)
        self._calls = None if calls is None else weakref.ref(calls)
        self._fit_callbacks = (
            None if calls is None else [weakref.ref(c) for c in calls.callbacks if c is not self]
        )
        # A fit of this process that an exception or Ctrl-C ended left its callback on this
        # directory mid-run (Keras skips on_train_end): it lets go first (lock, SIGTERM
        # handler, background saves), so a rebuilt model resumes in the same process.
        previous = _RUNNING.get(self.backup_dir)
        previous = previous() if previous is not None else None
        if previous is not None and previous is not self and not previous._in_fit():
            previous._abandon()
        if context.kind is not None:
            # Inside an Accelerator call: let go as soon as the call ends, however it ends.
            context.call_on_exit(self._abandon)
        try:
            if process.is_chief():
                self._prepare_directory()
                self._lock.acquire(model)
            # The others read the directory once the chief has made (or cleaned) it.
            process.barrier("keras_accel.BackupAndRestore.on_train_begin", model)
            self.restore()
        except BaseException:
            # Leave the directory as it was: nothing saved, nobody locked out.
            self._close()
            self._lock.release()
            self._training = False
            self._calls = None
            raise
        _RUNNING[self.backup_dir] = weakref.ref(self)
        self._stop_watch()  # One a fit that raised left behind.
        self._watch, self._preempted = Watch(model), False

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        self._last_batch_seen = 0
        if self._sets_initial_epoch:
            # Keras read the epoch to start at before the first epoch began: nothing needs
            # it now, and a later fit would skip epochs (a fit that raises never gets to
            # `on_train_end`, where it is cleared too).
            keras_internals.set_initial_epoch(self._model, None)
            self._sets_initial_epoch = False

    def fusion_period(self, kind: str, steps: int | None) -> int | None:
        """Host-loop fusion (`keras_accel.adapter.protocol`): with `save_freq=N` every group
        of fused steps must end where a backup falls, so groups divide N and the epoch."""
        if kind != "train" or not isinstance(self.save_freq, int) or self.save_freq is False:
            return None
        return math.gcd(self.save_freq, steps) if steps else self.save_freq

    def on_train_batch_end(self, batch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps:  # Keras numbers a fused last group past the epoch's end.
            batch = min(batch, steps - 1)
        # Every process asks at every batch end, so that all agree on the same one.
        preempted = self._watch is not None and self._watch.reached()
        context = run_context(self._model)
        if self._replay is not None and context.replaying(self._current_epoch, batch + 1):
            if preempted:  # Nothing new since the backup this run restored.
                self._preempt(None)
            return  # Still before the restored position.
        if self._replay is not None:
            self._finish_replay()
            self._last_batch_seen = batch
            return
        previous = self._last_batch if self._current_epoch == self._batch_epoch else -1
        self._steps_done += batch - previous
        self._last_batch, self._batch_epoch = batch, self._current_epoch
        self._last_batch_seen = batch
        if process.is_chief():
            self._lock.heartbeat()
        due = isinstance(self.save_freq, int) and self.save_freq is not False
        due = due and self._steps_done - self._last_saved >= self.save_freq
        if not (due or preempted):
            return
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:
            # The epoch's last batch: save after validation and the epoch's History row.
            self._save_at_epoch_end = True
            self._preempted = self._preempted or preempted
            return
        path = self.save(self._current_epoch, batch + 1)
        if preempted:
            self._preempt(path)

    def on_epoch_end(self, epoch, logs=None):
        run_context(self._model).replay_epoch = None
        self._current_epoch, self._last_batch_seen = epoch + 1, 0
        if self.save_freq == "epoch" or self._save_at_epoch_end:
            self._save_at_epoch_end = False
            path = self.save(epoch + 1, 0, logs=logs, finished_epoch=epoch)
            if self._preempted:
                self._preempt(path)

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()

    def _preempt(self, path: str | None) -> None:
        """SIGTERM reached every process: the backup is on disk, then the fit ends with
        `Preempted` (exit code 143). What `on_train_end` would do is done here, since Keras
        skips it when a callback raises; the backups stay for the next run."""
        try:
            self.wait()
        finally:
            self._training = False
            self._stop_watch()
            self._close()
            if process.is_chief():
                self._lock.release()
        where = f"saved {path}" if path else "the last backup is the one this run restored"
        message = (
            f"BackupAndRestore: SIGTERM (preemption) reached every process; {where}. The next "
            f"run with backup_dir={self.backup_dir!r} resumes from it."
        )
        print_msg(message)  # SystemExit prints nothing of its own.
        raise Preempted(message)

    def _in_fit(self) -> bool:
        """Whether this callback's fit is running now, in any thread of this process. A fit
        that an exception or Ctrl-C ended never ran `on_train_end`, so `_training` alone
        cannot say; its CallbackList is then on no thread's stack (a notebook may still
        hold it, in the traceback it keeps). Hooks called directly, without a fit, run
        until `on_train_end`."""
        if not self._training:
            return False
        return True if self._calls is None else _on_a_stack(self._calls)

    def _abandon(self) -> None:
        """Let go of a fit that ended without `on_train_end` (an exception, Ctrl-C,
        SystemExit): the SIGTERM handler, the epoch a restore set on the model, the saves
        in flight (finished, not dropped), the engine and the lock. The backups stay, for
        the next fit to resume from. Nothing to do once `on_train_end` ran."""
        if not self._training:
            return
        self._training = False
        self._stop_watch()
        if self._sets_initial_epoch and self._model is not None:
            keras_internals.set_initial_epoch(self._model, None)
        self._sets_initial_epoch = False
        self._replay = None
        self._fit_callbacks = None
        self._calls = None
        try:
            with contextlib.suppress(Exception):  # The fit's own error is the news.
                self.wait()
        finally:
            self._close()
            if process.is_chief():
                self._lock.release()

    def on_train_end(self, logs=None):
        self._training = False
        self._calls = None
        self._stop_watch()
        model = self._model
        # Keras never clears the epoch a restore set: a later fit would skip epochs.
        keras_internals.set_initial_epoch(model, None)
        self._sets_initial_epoch = False
        context = run_context(model)
        context.resumed_at = None
        context.replay_epoch = None
        self._replay = None
        self._fit_callbacks = None
        try:
            self.wait()  # The last save is on disk before fit returns.
            if self.delete_checkpoint:
                # Every process: an engine's deletion may be collective (Orbax's is).
                self._delete_all()
        finally:
            self._close()
            if process.is_chief():
                self._lock.release()

    # ------------------------------------------------------------------ engine
    def _open(self):
        if self._engine is None:
            # A fit of this process that an exception ended (Keras then skips on_train_end)
            # may still be writing here in the background: let it finish first.
            previous = _OPEN.pop(self.backup_dir, None)
            if previous is not None:
                with contextlib.suppress(Exception):
                    previous.close()
            self._engine = engines.open_engine(
                self._engine_module,
                self.backup_dir,
                self.max_to_keep,
                asynchronous=self.save_on_background,
            )
            _OPEN[self.backup_dir] = self._engine
            _wait_at_exit()
        return self._engine

    def _close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            if _OPEN.get(self.backup_dir) is engine:
                del _OPEN[self.backup_dir]
            with contextlib.suppress(Exception):
                engine.close()

    def wait(self) -> None:
        """Block until every backup this callback started is on disk.

        Raises:
            OSError: a background save failed (a full disk, a path that became unwritable),
                naming the directory, the step, the cause and the newest intact backup; the
                failed step's files are removed, the backups before it are intact.
        """
        if self._engine is None:
            return
        try:
            self._engine.wait()
        except Exception as error:
            raise self._save_error(_WRITING.get(self.backup_dir), error) from error
        finally:
            _WRITING.pop(self.backup_dir, None)

    def _save_error(self, step: int | None, error: Exception) -> OSError:
        return _write_error(self.backup_dir, step, error, self._engine)

    # ------------------------------------------------------------------ saving
    def save(
        self, epoch: int, batch: int, logs: dict | None = None, finished_epoch: int | None = None
    ) -> str | None:
        """Back up the state at `batch` batches into `epoch` (batch 0: the epoch's start).

        Every process calls this (the engine writes each one's share). With
        `save_on_background=True` it returns once the state is copied off the devices; call
        `wait()` to know it is on disk. Returns the backup's path.
        """
        model = self.model
        callbacks = self._callback_states(finished_epoch, logs)
        self._last_saved = self._steps_done
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        state = tree.variables(model)
        steps = (self.params or {}).get("steps")
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "epoch": int(epoch),
            "batch": int(batch),
            "steps_done": int(self._steps_done),
            "steps_per_epoch": None if steps is None else int(steps),
            "iterations": _optional_int(getattr(model.optimizer, "iterations", None)),
            "learning_rate": _optional_rate(model.optimizer),
            "callbacks": callbacks,
            "rng": tree.rng_state(),
            "manifest": tree.manifest(state),
            "backend": keras.backend.backend(),
            "engine": self._engine_module.NAME,
            "keras_version": keras.__version__,
            "keras_accel_version": _version(),
            "time": time.time(),
        }
        engine = self._open()
        # One checkpoint per training position, numbered by it: the steps done (the same as
        # epoch * steps + batch when the epoch length is known, which a direct call uses).
        step = int(epoch) * int(steps) + int(batch) if steps else int(self._steps_done)
        # The save before this one, if still in flight, is on disk first: a failure of it
        # is named as its own step's, not this one's.
        self.wait()
        try:
            if engine.has(step):
                # Only a backup this run restored past (an unusable one) sits at a step not
                # yet done; this replaces it.
                engine.wait()
                engine.delete(step)
            _WRITING[self.backup_dir] = step
            engine.save(step, state, meta)
            if not self.save_on_background:
                engine.wait()
                del _WRITING[self.backup_dir]
        except Exception as error:
            _WRITING.pop(self.backup_dir, None)
            raise self._save_error(step, error) from error
        if process.is_chief():
            # Rate-limited: a forced one (an fsynced write) cost a third of the save.
            self._lock.heartbeat()
            self._remove_keras_files()
        path = engine.path(step)
        if self.verbose > 0:
            print_msg(f"\nBackupAndRestore: saved {path}")
        return path

    def _stateful(self) -> dict:
        """{state key: callback} for the callbacks of this fit with `state_dict` and
        `load_state_dict` (this one aside)."""
        if self._fit_callbacks is None:  # Not inside a fit's callback list: Keras's handle.
            candidates = [getattr(self._model, "history", None)]
        else:
            candidates = [ref() for ref in self._fit_callbacks]
        found: dict = {}
        for callback in candidates:
            if callback is self or not (
                callable(getattr(callback, "state_dict", None))
                and callable(getattr(callback, "load_state_dict", None))
            ):
                continue
            key = str(getattr(callback, "state_key", None) or type(callback).__name__)
            if key in found and found[key] is not callback:
                raise RuntimeError(
                    f"BackupAndRestore: two callbacks of this fit save their state under the "
                    f"same key {key!r} ({found[key]!r} and {callback!r}), so a resume could "
                    "not tell them apart. Give each a distinct `state_key` attribute."
                )
            found[key] = callback
        return found

    def _callback_states(self, finished_epoch: int | None, logs: dict | None) -> dict:
        """Every stateful callback's `state_dict()`, checked to be JSON-able (the record
        the engine commits is JSON). At an epoch's end, the run context says which epoch
        ended, for callbacks whose own `on_epoch_end` has not run yet."""
        context = run_context(self._model)
        context.epoch_end = None if finished_epoch is None else (int(finished_epoch), logs or {})
        try:
            states = {key: callback.state_dict() for key, callback in self._stateful().items()}
        finally:
            context.epoch_end = None
        for key, state in states.items():
            try:
                json.dumps(state)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"BackupAndRestore: the state_dict() of the callback {key!r} cannot be "
                    f"saved: it must be JSON-able (dicts, lists, strings, numbers, bool, "
                    f"None). {type(e).__name__}: {e}"
                ) from e
        return states

    def _check_version(self, meta: dict, path: str) -> None:
        """A backup of a later format is refused before anything is restored from it."""
        version = meta.get("version", 1)
        if isinstance(version, int) and version > VERSION:
            raise ValueError(
                f"BackupAndRestore: the backup {path!r} is of format version {version}, "
                f"written by keras_accel {meta.get('keras_accel_version', '?')}; this "
                f"keras_accel reads versions up to {VERSION}. Upgrade keras_accel to resume "
                "from it, or point backup_dir elsewhere to start afresh."
            )

    def _load_callback_states(self, meta: dict) -> None:
        states = meta.get("callbacks")
        stateful = self._stateful()
        if states is None and meta.get("history"):
            # A version 2 backup: the History record alone.
            states = {
                key: meta["history"]
                for key, callback in stateful.items()
                if isinstance(callback, History)
            }
        for key, state in (states or {}).items():
            if key in stateful:
                stateful[key].load_state_dict(state)

    def _remove_keras_files(self) -> None:
        # A Keras backup this run resumed from: the backup just started holds a later
        # state, as Keras's own next save would overwrite its file.
        for name in self._listdir():
            if name in KERAS_FILES:
                _quietly(files.remove, files.join(self.backup_dir, name))

    def _delete_all(self) -> None:
        """Every process calls this: the engine deletes (Orbax meets the other processes
        there; tf.train deletes from the chief only), then the chief tidies the directory."""
        self._open().delete_all()
        if not process.is_chief():
            return
        self._remove_keras_files()
        remaining = [n for n in self._listdir() if n != LOCK_NAME]
        self._lock.release()
        if not remaining and files.isdir(self.backup_dir):
            _quietly(files.rmtree, self.backup_dir)

    # ------------------------------------------------------------------ restoring
    def checkpoints(self) -> list[str]:
        """Paths of the complete backups, oldest first."""
        if not files.isdir(self.backup_dir):
            return []
        engine = self._open()
        return [engine.path(step) for step in engine.steps()]

    def restore(self) -> bool:
        """Restore the newest intact backup into the model; False if there is none.

        Each backup's files are checked against the sizes and CRC32Cs its commit recorded
        first. A damaged one is named in a warning and set aside under `damaged/` (kept,
        never listed again) once an older one restores; one that cannot be read for another
        reason is skipped with a warning naming it. None intact raises a RuntimeError naming
        each. One that does not fit the model raises a ValueError naming the variables, as
        does a change in the number of batches per epoch when the backup was taken mid-epoch.
        """
        if not files.isdir(self.backup_dir):
            return False
        listed = set(self._listdir())
        keras_files = [name for name in KERAS_FILES if name in listed]
        engine = self._open()
        engine.wait()
        steps = engine.steps()
        self._warn_interrupted(engine, steps)
        self._check_layout(listed, steps)
        if keras_files:
            if steps:
                raise RuntimeError(
                    f"BackupAndRestore: backup_dir {self.backup_dir!r} holds a backup written "
                    f"by keras.callbacks.BackupAndRestore ({', '.join(keras_files)}) and "
                    f"backups written by keras_accel (steps {steps}), so which one is newer "
                    "is unclear. Move away the one not to resume from, or use another "
                    "backup_dir."
                )
            self._restore_keras(keras_files)
            return True
        unusable = []  # (step, path, why): passed over, none restored yet.
        damaged = []  # (step, checksums.Damaged): set aside once an intact one restores.
        for step in reversed(steps):
            path = engine.path(step)
            try:
                # Every file against the sizes and CRC32Cs its commit recorded, before
                # anything of it is read (tf.train checks its own as it reads).
                engine.verify(step)
                meta = engine.read_meta(step)
                if meta.get("format") != FORMAT:
                    raise ValueError(f"not a {FORMAT} backup (format={meta.get('format')!r})")
            except checksums.Damaged as damage:
                damaged.append((step, damage))
                unusable.append((step, path, str(damage)))
                continue
            except Exception as error:  # Whatever the engine raises for a damaged record.
                self._skip(path, error)
                unusable.append((step, path, f"{type(error).__name__}: {str(error)[:300]}"))
                continue
            self._check_version(meta, path)
            self._check_steps(meta, path)
            state = self._keyed_as(self._state(), meta["manifest"])
            chosen = tree.to_restore(state, meta["manifest"], repr(path), self.partial_restore)
            try:
                engine.restore(step, chosen, meta["manifest"])
            except checksums.Damaged as damage:
                damaged.append((step, damage))
                unusable.append((step, path, str(damage)))
                continue
            except Exception as error:
                self._skip(path, error)
                unusable.append((step, path, f"{type(error).__name__}: {str(error)[:300]}"))
                continue
            self._set_aside(engine, damaged, step)
            self._apply(meta, chosen, path)
            return True
        if unusable:
            raise _faults.none_intact_error(self.backup_dir, unusable)
        return False

    def _set_aside(self, engine, damaged: list, intact: int) -> None:
        """Move the damaged steps found newer than the restored step `intact` out of the
        engine's listing (kept under `damaged/`, never resumed from or counted as the latest
        again), each with a warning naming the step, the file and what differs. Across
        processes every one has read them before the chief moves them (a barrier), and none
        goes on before they are gone."""
        if not damaged:
            return
        several = process.num_processes() > 1
        if several:
            process.barrier("keras_accel.BackupAndRestore.damaged", self._model)
        for step, damage in damaged:
            where, why = None, ""
            try:
                where = engine.set_aside(step)
            except Exception as error:  # The warning says so; the restore goes on.
                why = f"{type(error).__name__}: {error}"
            warnings.warn(
                _faults.damaged_warning(self.backup_dir, step, damage, where, why, intact),
                stacklevel=4,
            )
        if several:
            process.barrier("keras_accel.BackupAndRestore.set_aside", self._model)

    def _warn_interrupted(self, engine, steps: list[int]) -> None:
        """A save that never committed is no backup, but a run never drops one silently."""
        interrupted, engine.interrupted = list(getattr(engine, "interrupted", [])), []
        if not interrupted:
            return
        which = ", ".join(str(step) for step in interrupted)
        warnings.warn(
            f"BackupAndRestore: the backup of step {which} in {self.backup_dir!r} was still "
            "being written when its process ended (killed, or gone before the save finished), "
            f"so {self._engine_module.NAME} never committed it; its partial files are removed. "
            + (
                f"Resuming from the complete backups (steps {steps}), newest first."
                if steps
                else "There is no complete backup: training starts from the beginning."
            ),
            stacklevel=3,
        )

    @staticmethod
    def _skip(path: str, error: Exception) -> None:
        warnings.warn(
            f"BackupAndRestore: skipping the unusable backup {path!r} "
            f"({type(error).__name__}: {str(error)[:300]}); using the one before it.",
            stacklevel=3,
        )

    def _state(self) -> dict:
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # Its variables are restored too.
        return tree.variables(model)

    def _keyed_as(self, state: dict, saved: dict) -> dict:
        """`state` under the keys of a backup's manifest: older backups keyed seed states
        by Keras's creation-ordered names (`tree.readable`); a model built again in this
        Python session has Keras's next automatic names (`tree.renumbered`)."""
        readable = tree.readable(state, tree.variables(self.model, legacy=True), saved)
        return tree.renumbered(readable, saved)

    def _check_layout(self, listed: set[str], steps: list[int]) -> None:
        """A directory of another format is refused with what it is, never ignored."""
        if steps:
            return
        old = sorted(name for name in listed if name.startswith("ckpt-e") and "-b" in name)
        other = None
        if old:
            other = f"keras_accel 0.1's npz backups ({', '.join(old[:3])})"
        elif self._engine_module.NAME != "orbax" and any(name.isdigit() for name in listed):
            other = "Orbax checkpoints (numbered directories: written on KERAS_BACKEND=jax)"
        elif self._engine_module.NAME != "orbax" and _staged(listed, "orbax"):
            other = "Orbax checkpoints (orbax-<step> prefixes: written on KERAS_BACKEND=jax)"
        elif self._engine_module.NAME != "tf.train" and _staged(listed, "tf"):
            other = "tf.train checkpoints (tf-<step> prefixes: written on KERAS_BACKEND=tensorflow)"
        elif self._engine_module.NAME != "tf.train" and "checkpoint" in listed:
            other = "tf.train checkpoints (written on KERAS_BACKEND=tensorflow)"
        elif self._engine_module.NAME != "torch.distributed.checkpoint" and any(
            name.startswith("dcp-") and name[4:].isdigit() for name in listed
        ):
            other = (
                "torch.distributed.checkpoint checkpoints (dcp-<step> directories: written "
                "on KERAS_BACKEND=torch)"
            )
        if other:
            raise RuntimeError(
                f"BackupAndRestore: backup_dir {self.backup_dir!r} holds {other}, which "
                f"{self._engine_module.NAME} on KERAS_BACKEND={keras.backend.backend()} cannot "
                "resume from. Resume with the backend that wrote them, or move them away to "
                "start from scratch."
            )

    def _check_steps(self, meta: dict, path: str) -> None:
        epoch, batch = int(meta["epoch"]), int(meta["batch"])
        steps = (self.params or {}).get("steps")
        if batch and steps is not None and meta.get("steps_per_epoch") not in (None, steps):
            raise ValueError(
                f"The backup {path!r} was taken {batch} batches into epoch {epoch + 1}, with "
                f"{meta['steps_per_epoch']} batches per epoch; this fit has {steps}. A "
                "mid-epoch resume needs the same data and batch size. Restore with the "
                "original settings, or use another backup_dir."
            )

    def _apply(self, meta: dict, restored: dict, path: str) -> None:
        model = self.model
        epoch, batch = int(meta["epoch"]), int(meta["batch"])
        tree.set_rng_state(meta["rng"])
        self._load_callback_states(meta)
        keras_internals.set_initial_epoch(model, epoch)
        self._sets_initial_epoch = True
        context = run_context(model)
        context.resumed_at = (epoch, batch)
        context.restores += 1
        if batch:
            context.replay_epoch, context.replay_batch = epoch, batch
            self._replay = {
                "values": tree.snapshot(restored),
                "rng": meta["rng"],
                "manifest": meta["manifest"],
            }
        self._steps_done = self._last_saved = int(meta["steps_done"])
        self._last_batch, self._batch_epoch = batch - 1, epoch
        self._current_epoch, self._last_batch_seen = epoch, max(batch - 1, 0)
        if self.verbose > 0:
            print_msg(f"BackupAndRestore: restored {path} (epoch {epoch + 1}, batch {batch})")

    def _finish_replay(self) -> None:
        """The re-run batches reached the backup's position: assign its state again."""
        replay, self._replay = self._replay, None
        model = self.model  # On JAX, pulls the training state onto the variables first.
        tree.assign(self._keyed_as(tree.variables(model), replay["manifest"]), replay["values"])
        tree.set_rng_state(replay["rng"])
        # `replay_epoch` stays set until the epoch ends: callbacks after this one in the
        # list must still see this batch as a replayed one.
        run_context(model).restores += 1

    def _restore_keras(self, found: list[str]) -> None:
        """Resume from what `keras.callbacks.BackupAndRestore` wrote, as Keras would.

        Its backup holds the weights with the optimizer's variables and the epoch to start
        at (no metric totals, random states or History record); Keras starts that epoch from
        its first batch, and so does this. As in Keras, a backup that fails to load falls
        back to the `.bkp` pair of `double_checkpoint=True`. The next backup is written in
        keras_accel's layout and replaces Keras's files.
        """
        pairs = [(KERAS_WEIGHTS, KERAS_METADATA), (f"{KERAS_WEIGHTS}.bkp", f"{KERAS_METADATA}.bkp")]
        failures = []
        for weights, metadata in pairs:
            if weights not in found and metadata not in found:
                continue
            try:
                epoch, batch = self._load_keras(
                    weights if weights in found else None, metadata if metadata in found else None
                )
            except (OSError, ValueError, KeyError, TypeError) as e:
                failures.append(f"{weights}: {type(e).__name__}: {e}")
                continue
            break
        else:
            raise RuntimeError(
                f"BackupAndRestore: backup_dir {self.backup_dir!r} holds a backup written by "
                f"keras.callbacks.BackupAndRestore ({', '.join(found)}), but it cannot be "
                f"loaded into this model: {'; '.join(failures)}. Resume it with the model it "
                "was saved from, or move the files away to start from scratch."
            )
        model = self._model
        steps = (self.params or {}).get("steps")
        keras_internals.set_initial_epoch(model, epoch)
        self._sets_initial_epoch = True
        context = run_context(model)
        context.resumed_at = (epoch, 0)
        context.restores += 1
        self._current_epoch, self._last_batch_seen = epoch, 0
        self._steps_done = self._last_saved = epoch * int(steps or 0)
        self._last_batch, self._batch_epoch = -1, epoch
        inside = (
            f" It was taken {batch + 1} batches into epoch {epoch + 1}: Keras's backups do "
            "not record enough to resume inside an epoch, so that epoch starts again from "
            "its first batch, as with Keras's callback."
            if batch
            else ""
        )
        warnings.warn(
            f"BackupAndRestore: resuming from a backup written by "
            f"keras.callbacks.BackupAndRestore in {self.backup_dir!r} ({', '.join(found)}): "
            f"the weights and optimizer state, starting at epoch {epoch + 1}.{inside} The next "
            "backup is written by the engine and replaces "
            "these files.",
            stacklevel=2,
        )

    def _load_keras(self, weights: str | None, metadata: str | None) -> tuple[int, int]:
        """Load one Keras weights/metadata pair; `(epoch, batch)` from the metadata."""
        model = self.model
        epoch = batch = 0
        if metadata is not None:
            record = json.loads(files.read_text(files.join(self.backup_dir, metadata)))
            epoch, batch = int(record["epoch"]), int(record.get("batch", 0))
        if weights is not None:
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)  # Its variables are saved too.
            with files.local_copy(files.join(self.backup_dir, weights)) as local:
                if local.endswith(".weights.h5"):
                    model.load_weights(local)
                else:
                    # Keras picks the format by the file name: give the .bkp copy the name
                    # of the file it copies.
                    with tempfile.TemporaryDirectory(prefix="keras_accel-") as directory:
                        named = os.path.join(directory, KERAS_WEIGHTS)
                        os.symlink(os.path.abspath(local), named)
                        model.load_weights(named)
        return epoch, batch

    # ------------------------------------------------------------------ Keras's attributes
    # Keras's BackupAndRestore keeps one backup at fixed paths (and the one before it, with
    # double_checkpoint=True); code written for it, Keras's tests among it, reads them. Here
    # they name the newest and second-newest complete backup (the engine's arrays, and the
    # record that holds the epoch and batch), or are None where there is none.
    @property
    def _weights_path(self) -> str | None:
        return self._backup_file(1, 0)

    @property
    def _training_metadata_path(self) -> str | None:
        return self._backup_file(1, 1)

    @property
    def _prev_weights_path(self) -> str | None:
        return self._backup_file(2, 0)

    @property
    def _prev_training_metadata_path(self) -> str | None:
        return self._backup_file(2, 1)

    def _backup_file(self, newest: int, which: int) -> str | None:
        if not files.isdir(self.backup_dir):
            return None
        engine = self._open()
        steps = engine.steps()
        return engine.files(steps[-newest])[which] if len(steps) >= newest else None

    # ------------------------------------------------------------------ directory
    def _prepare_directory(self) -> None:
        path = self.backup_dir
        try:
            if files.exists(path) and not files.isdir(path):
                raise NotADirectoryError(
                    f"BackupAndRestore: backup_dir {path!r} is a file, not a directory. "
                    "Point backup_dir at a directory (it is created if missing)."
                )
            files.makedirs(path)
        except NotADirectoryError as e:
            if "is a file, not a directory" in str(e):
                raise
            raise NotADirectoryError(
                f"BackupAndRestore: cannot create backup_dir {path!r}: a part of it is a file "
                f"({e}). Point backup_dir at a directory."
            ) from e
        except FileExistsError as e:
            raise NotADirectoryError(
                f"BackupAndRestore: cannot create backup_dir {path!r}: a part of it is a file "
                f"({e}). Point backup_dir at a directory."
            ) from e
        except OSError as e:
            raise PermissionError(
                f"BackupAndRestore: cannot create or write backup_dir {path!r}: {e}. Point "
                "backup_dir at a writable directory (local path or URL)."
            ) from e

    def _listdir(self) -> list[str]:
        try:
            return files.listdir(self.backup_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []


def _on_a_stack(ref: weakref.ref) -> bool:
    """Whether a frame running now, in any thread, holds the object of `ref` among its
    locals (this function's own frame aside: it holds it to compare)."""
    here = inspect.currentframe()
    target = ref()
    if target is None:
        return False
    for top in library_internals.current_frames().values():
        frame = top
        while frame is not None:
            if frame is not here and any(value is target for value in frame.f_locals.values()):
                return True
            frame = frame.f_back
    return False


def _staged(names: set[str], tag: str) -> bool:
    """Whether `names` hold staged checkpoints `<tag>-<step>` (keras_accel.state.staged)."""
    return any(name.startswith(f"{tag}-") and name[len(tag) + 1 :].isdigit() for name in names)


def _optional_rate(optimizer) -> float | None:
    """The rate the optimizer applies at its next step, for the record (None if unread)."""
    if optimizer is None:
        return None
    try:
        return optimizer_rate(optimizer)
    except (TypeError, ValueError, AttributeError):
        return None


def _optional_int(value) -> int | None:
    if value is None:
        return None
    try:
        return int(value.numpy() if hasattr(value, "numpy") else value)
    except (TypeError, ValueError):
        return None


def _version() -> str:
    from keras_accel.utils.version import __version__

    return __version__


def _quietly(function, *args) -> None:
    with contextlib.suppress(OSError, ValueError):
        function(*args)


def _write_error(directory: str, step: int | None, error: Exception, engine) -> OSError:
    """`_faults.write_error` with the engine's committed steps (None where it cannot list
    them now)."""
    intact = None
    if engine is not None:
        with contextlib.suppress(Exception):
            intact = engine.steps()
    return _faults.write_error(
        directory, step, error, intact, engine.path if engine is not None else str
    )
