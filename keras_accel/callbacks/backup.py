"""`BackupAndRestore`: the full training state, on Orbax (JAX), tf.train (TensorFlow) or
torch.distributed.checkpoint (torch), keyed by variable path, saved asynchronously and
rotated, resumed exactly.

The Keras-facing shell: the callback's hooks and public API, over the state package, which
does the work (`keras_accel.state.schedule`: when a backup is due; `.backups`: writing them;
`.recovery`: finding and restoring the newest intact one; `.record`: the JSON record each
commits; `.keras_backups`: resuming Keras's own), the directory's lock (`_lock`), the
preemption watch (`_preemption`), the other callbacks' states (`_callback_states`) and the
fits of this process (`_fits`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import keras

from keras_accel.adapter.protocol import run_context
from keras_accel.callbacks import _callback_states, _fits
from keras_accel.callbacks._lock import LOCK_NAME, DirectoryLock, check_timeout
from keras_accel.callbacks._preemption import Watch, preempted
from keras_accel.callbacks._resume import Resume
from keras_accel.callbacks.learning_rate import optimizer_rate
from keras_accel.state import (
    backups,
    checksums,
    engines,
    files,
    keras_backups,
    record,
    recovery,
    schedule,
    tree,
)
from keras_accel.utils import keras_internals, process
from keras_accel.utils.checks import check_positive_int
from keras_accel.utils.printing import print_msg


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
      replicated state over the processes (under `strategy="fsdp"` each process writes
      its own shards) and restores onto any number of processes.
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
      Under `Accelerator.fit` over arrays, memory maps, array-likes or a `PyDataset`, the
      resumed run begins that epoch at the backup's batch: nothing is computed for the
      batches before it, callbacks see the uninterrupted run's batch numbers, and the
      epoch's logs are the whole epoch's (the metrics' totals come from the backup).
      Elsewhere (a plain `model.fit`, generators, tf.data) Keras cannot start an epoch
      part-way, so the resumed run re-runs that epoch's first batches and, when it
      reaches the backup's position, restores the state again: their effect is
      overwritten. Either way training continues bit-for-bit as the uninterrupted run
      would (given a data order that depends only on the epoch, as `Accelerator.fit`
      guarantees). Other keras_accel callbacks ignore re-run batches, and yours can
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
        signing_key: bytes or a str (its UTF-8 bytes); None reads the environment variable
            `KERAS_ACCEL_SIGNING_KEY` (for launchers; the argument wins), and without
            either nothing is signed. With a key every backup's checksum record carries an
            HMAC-SHA256 of its files' digests and its step, and a restore refuses as
            tampered (named, set aside under `damaged/`, the newest intact step restored)
            a step whose record does not verify under the key, or that has none
            (docs/callbacks.md, "Signed backups"). Give every process the same key.

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
        signing_key: bytes | str | None = None,
    ):
        # The Keras internals our callbacks rely on, checked once, under a plain model.fit too.
        keras_internals.check()
        super().__init__()
        backups.check_directory(backup_dir)
        schedule.check_save_freq(save_freq)
        max_to_keep = check_positive_int("max_to_keep", max_to_keep)
        check_timeout(lock_timeout)
        engine_module = engines.engine_module(keras.backend.backend())
        backup_dir = backups.writable_directory(backup_dir, engine_module)
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max(max_to_keep, 2) if double_checkpoint else max_to_keep
        self.lock_timeout = lock_timeout
        self.verbose = verbose
        self.save_on_background = bool(save_on_background)
        self.partial_restore = bool(partial_restore)
        self._engine_name = engine_module.NAME
        # Private, and never logged or written: only its HMACs are.
        key = checksums.signing_key(signing_key)
        self._backups = backups.Backups(
            backup_dir, engine_module, self.max_to_keep, self.save_on_background, key
        )
        self._lock = DirectoryLock(backup_dir, lock_timeout, self, self._in_fit)
        self._schedule = schedule.Schedule()
        self._training = False
        # Keras's names and meaning (code and Keras's tests read them): the epoch in progress
        # (after an epoch ends: the number of epochs done), and the index of the last training
        # batch of this epoch (0 at the start of each epoch).
        self._current_epoch = 0
        self._last_batch_seen = 0
        self._resume = Resume()  # Where a restore puts the fit (and the mid-epoch replay).
        self._watch: Watch | None = None  # SIGTERM -> a last backup (`_preemption`).
        self._preempted = False
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
        self._schedule.reset()
        self._resume.begin(model)
        context = run_context(model)
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
        _fits.let_go_of_ended(self.backup_dir, self)
        if context.kind is not None:
            # Inside an Accelerator call: let go as soon as the call ends, however it ends.
            context.call_on_exit(self._abandon)
        try:
            if process.is_chief():
                self._backups.prepare()
                self._lock.acquire(model)
            # The others read the directory once the chief has made (or cleaned) it.
            process.barrier("keras_accel.BackupAndRestore.on_train_begin", model)
            self.restore()
        except BaseException:
            # Leave the directory as it was: nothing saved, nobody locked out.
            self._backups.close()
            self._lock.release()
            self._training = False
            self._calls = None
            raise
        _fits.hold(self.backup_dir, self._in_fit, self._abandon)
        self._stop_watch()  # One a fit that raised left behind.
        self._watch, self._preempted = Watch(model), False

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        self._last_batch_seen = 0
        self._resume.epoch_began(self._model, epoch)

    def fusion_period(self, kind: str, steps: int | None) -> int | None:
        """Host-loop fusion (`keras_accel.adapter.protocol`): with `save_freq=N` every group
        of fused steps must end where a backup falls, so groups divide N and the epoch."""
        return schedule.fusion_period(self.save_freq, kind, steps)

    def on_train_batch_begin(self, batch, logs=None):
        self._resume.batch_began()  # An epoch begun late: its first step's generators.

    def on_train_batch_end(self, batch, logs=None):
        steps = self._steps_per_epoch()
        if steps:  # Keras numbers a fused last group past the epoch's end.
            batch = min(batch, steps - 1)
        # Every process asks at every batch end, so that all agree on the same one.
        preempted = self._watch is not None and self._watch.reached()
        if self._resume.replaying(self._model, self._current_epoch, batch + 1):
            if preempted:  # Nothing new since the backup this run restored.
                self._preempt(None)
            return  # Still before the restored position.
        if self._resume.replay is not None:
            self._resume.finish_replay(self.model)
            self._last_batch_seen = batch
            return
        self._schedule.count(self._current_epoch, batch)
        self._last_batch_seen = batch
        if process.is_chief():
            self._lock.heartbeat()
        if not (self._schedule.due(self.save_freq) or preempted):
            return
        if steps and batch + 1 >= steps:
            # The epoch's last batch: save after validation and the epoch's History row.
            self._schedule.at_epoch_end = True
            self._preempted = self._preempted or preempted
            return
        path = self.save(self._current_epoch, batch + 1)
        if preempted:
            self._preempt(path)

    def on_epoch_end(self, epoch, logs=None):
        run_context(self._model).replay_epoch = None
        self._resume.epoch_ended(epoch)  # A late epoch's batches numbered as Keras's again.
        self._current_epoch, self._last_batch_seen = epoch + 1, 0
        if self.save_freq == "epoch" or self._schedule.at_epoch_end:
            self._schedule.at_epoch_end = False
            path = self.save(epoch + 1, 0, logs=logs, finished_epoch=epoch)
            if self._preempted:
                self._preempt(path)

    def on_train_end(self, logs=None):
        self._training = False
        self._calls = None
        self._stop_watch()
        self._resume.end(self._model)
        self._fit_callbacks = None
        try:
            self.wait()  # The last save is on disk before fit returns.
            if self.delete_checkpoint:
                # Every process: an engine's deletion may be collective (Orbax's is).
                self._delete_all()
        finally:
            self._let_go()

    # ------------------------------------------------------------------ ends of a fit
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
            self._let_go()
        raise preempted(self.backup_dir, path)

    def _in_fit(self) -> bool:
        """Whether this callback's fit is running now, in any thread of this process. A fit
        that an exception or Ctrl-C ended never ran `on_train_end`, so `_training` alone
        cannot say; its CallbackList is then on no thread's stack (a notebook may still
        hold it, in the traceback it keeps). Hooks called directly, without a fit, run
        until `on_train_end`."""
        if not self._training:
            return False
        return True if self._calls is None else _fits.on_a_stack(self._calls)

    def _abandon(self) -> None:
        """Let go of a fit that ended without `on_train_end` (an exception, Ctrl-C,
        SystemExit): the SIGTERM handler, the epoch a restore set on the model, the saves
        in flight (finished, not dropped), the engine and the lock. The backups stay, for
        the next fit to resume from. Nothing to do once `on_train_end` ran."""
        if not self._training:
            return
        self._training = False
        self._stop_watch()
        self._resume.abandon(self._model)
        self._fit_callbacks = None
        self._calls = None
        try:
            with contextlib.suppress(Exception):  # The fit's own error is the news.
                self.wait()
        finally:
            self._let_go()

    def _let_go(self) -> None:
        """Close the engine and, on the chief, release the directory's lock."""
        self._backups.close()
        if process.is_chief():
            self._lock.release()

    def _delete_all(self) -> None:
        """Every process calls this: the engine deletes (Orbax meets the other processes
        there; tf.train deletes from the chief only), then the chief tidies the directory."""
        self._backups.delete_all()
        if not process.is_chief():
            return
        self._backups.remove_keras_files()
        remaining = [n for n in self._backups.listdir() if n != LOCK_NAME]
        self._lock.release()
        if not remaining:
            self._backups.remove_directory()

    # ------------------------------------------------------------------ saving
    def wait(self) -> None:
        """Block until every backup this callback started is on disk.

        Raises:
            OSError: a background save failed (a full disk, a path that became unwritable),
                naming the directory, the step, the cause and the newest intact backup; the
                failed step's files are removed, the backups before it are intact.
        """
        self._backups.wait()

    def save(
        self, epoch: int, batch: int, logs: dict | None = None, finished_epoch: int | None = None
    ) -> str | None:
        """Back up the state at `batch` batches into `epoch` (batch 0: the epoch's start).

        Every process calls this (the engine writes each one's share). With
        `save_on_background=True` it returns once the state is copied off the devices; call
        `wait()` to know it is on disk. Returns the backup's path.
        """
        model = self.model
        states = _callback_states.gather(self._stateful(), self._model, finished_epoch, logs)
        self._schedule.saved()
        state = tree.built_variables(model)
        steps = self._steps_per_epoch()
        done = self._schedule.steps_done
        rate = _optional_rate(model.optimizer)
        meta = record.build(
            model, state, epoch, batch, done, steps, rate, states, self._engine_name
        )
        metric_state = run_context(model).metric_state
        if metric_state is not None:  # Each process holds its share of the metrics' state.
            state = metric_state.for_backup(state)
        path = self._backups.save(schedule.step_of(epoch, batch, steps, done), state, meta)
        if process.is_chief():
            # Rate-limited: a forced one (an fsynced write) cost a third of the save.
            self._lock.heartbeat()
            self._backups.remove_keras_files()
        if self.verbose > 0:
            print_msg(f"\nBackupAndRestore: saved {path}")
        return path

    def _stateful(self) -> dict:
        return _callback_states.stateful(self, self._model, self._fit_callbacks)

    def _steps_per_epoch(self) -> int | None:
        return (self.params or {}).get("steps")

    # ------------------------------------------------------------------ restoring
    def checkpoints(self) -> list[str]:
        """Paths of the complete backups, oldest first."""
        return self._backups.paths()

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
        keras_files, steps = recovery.survey(self._backups)
        if keras_files:
            self._resume_keras(keras_files)
            return True
        restored = recovery.restore_newest(self._backups, steps, self._fit_to, self._model)
        if restored is None:
            return False
        self._apply(*restored)
        return True

    def _fit_to(self, meta: dict, path: str) -> dict:
        """The model's variables to restore the backup `meta` at `path` into."""
        record.check_version(meta, path)
        record.check_steps(meta, path, self._steps_per_epoch())
        model = self.model
        state = tree.keyed_as(model, tree.built_variables(model), meta["manifest"])
        return tree.to_restore(state, meta["manifest"], repr(path), self.partial_restore)

    def _apply(self, meta: dict, restored: dict, path: str) -> None:
        model = self.model
        epoch, batch = int(meta["epoch"]), int(meta["batch"])
        tree.set_rng_state(meta["rng"])
        _callback_states.load(meta, self._stateful())
        metric_state = run_context(model).metric_state
        if metric_state is not None:  # The metrics' state of one process: each its share.
            metric_state.after_restore(restored)
        calls = None if self._calls is None else self._calls()
        self._resume.restored(model, meta, restored, calls)
        self._schedule.resume(meta["steps_done"], epoch, batch)
        self._current_epoch, self._last_batch_seen = epoch, max(batch - 1, 0)
        if self.verbose > 0:
            print_msg(f"BackupAndRestore: restored {path} (epoch {epoch + 1}, batch {batch})")

    def _resume_keras(self, found: list[str]) -> None:
        """Resume from what `keras.callbacks.BackupAndRestore` wrote, as Keras would: from
        the start of its epoch. The next backup is written in keras_accel's layout and
        replaces Keras's files."""
        epoch, batch = keras_backups.load(self.model, self.backup_dir, found)
        self._resume.restored_keras(self._model, epoch)
        self._current_epoch, self._last_batch_seen = epoch, 0
        self._schedule.resume(epoch * int(self._steps_per_epoch() or 0), epoch, 0)
        warnings.warn(
            keras_backups.resume_warning(self.backup_dir, found, epoch, batch), stacklevel=2
        )

    # ------------------------------------------------------------------ Keras's attributes
    # Keras's BackupAndRestore keeps one backup at fixed paths (and the one before it, with
    # double_checkpoint=True); code written for it, Keras's tests among it, reads them. Here
    # they name the newest and second-newest complete backup (the engine's arrays, and the
    # record that holds the epoch and batch), or are None where there is none.
    @property
    def _weights_path(self) -> str | None:
        return self._backups.newest_files(1, 0)

    @property
    def _training_metadata_path(self) -> str | None:
        return self._backups.newest_files(1, 1)

    @property
    def _prev_weights_path(self) -> str | None:
        return self._backups.newest_files(2, 0)

    @property
    def _prev_training_metadata_path(self) -> str | None:
        return self._backups.newest_files(2, 1)


def _optional_rate(optimizer) -> float | None:
    """The rate the optimizer applies at its next step, for the record (None if unread)."""
    if optimizer is None:
        return None
    try:
        return optimizer_rate(optimizer)
    except (TypeError, ValueError, AttributeError):
        return None
