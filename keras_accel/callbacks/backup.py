"""`BackupAndRestore`: the full training state, saved atomically and rotated, resumed exactly."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
import warnings
import zipfile
from typing import Any

import keras

from keras_accel import io
from keras_accel.callbacks import _state
from keras_accel.callbacks._lock import LOCK_NAME, DirectoryLock
from keras_accel.callbacks._print import print_msg
from keras_accel.callbacks._run import run_state
from keras_accel.utils import process

FORMAT = "keras_accel.BackupAndRestore"
VERSION = 1
VARIABLES = "variables.npz"
STATE = "state.json"
COMMITTED = "COMMITTED"
_NAME = re.compile(r"^ckpt-e(\d{6,})-b(\d{8,})$")
# What `keras.callbacks.BackupAndRestore` writes into its backup_dir: the weights (with the
# optimizer's variables) and {"epoch": ..., "batch": ...}, and with double_checkpoint=True the
# previous pair as .bkp copies.
KERAS_WEIGHTS = "latest.weights.h5"
KERAS_METADATA = "training_metadata.json"
KERAS_FILES = (KERAS_WEIGHTS, KERAS_METADATA, f"{KERAS_WEIGHTS}.bkp", f"{KERAS_METADATA}.bkp")


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the whole training state, and resumes an interrupted `fit` exactly.

    A drop-in for `keras.callbacks.BackupAndRestore(backup_dir, save_freq="epoch",
    double_checkpoint=False, delete_checkpoint=True)`: run the same `fit` again after a
    crash and it continues from the last backup instead of epoch 0. It adds:

    - **the full state**: weights and non-trainable variables (BatchNormalization
      statistics, Dropout's seed-generator states), optimizer variables (slots, iteration
      count, learning rate, hence the position of a `LearningRateScheduler`), the running
      metric totals, epoch and batch, the `keras_accel.callbacks.History` record, and the
      Python and NumPy random generator states. Variables go to an `.npz` (read with
      `allow_pickle=False`), the rest to JSON: no pickle.
    - **mid-epoch resume**: with `save_freq=N` (steps) a backup can fall inside an epoch.
      Keras cannot start an epoch part-way, so the resumed run re-runs that epoch's first
      batches and, when it reaches the backup's position, restores the state again: their
      effect is overwritten, and training continues bit-for-bit as the uninterrupted run
      would (given a data order that depends only on the epoch, as `Accelerator.fit`
      guarantees). Other keras_accel callbacks ignore the re-run batches.
    - **rotation**: the newest `max_to_keep` backups are kept (default 5, as the seed's
      `CheckpointManager`), each in its own `ckpt-e<epoch>-b<batch>` directory.
    - **atomic**: a backup is written to a temporary directory, made durable (fsync),
      renamed into place, and marked complete by a `COMMITTED` file written last, holding
      checksums of the others. A backup without the marker, or whose checksums fail, is
      skipped with a warning and the one before it is used; nothing is overwritten before
      a new backup is complete.
    - **one run per directory**: a lock file makes a second run pointed at the same
      directory fail with a clear error while the first is alive.
    - **any path**: a local directory or a URL (`gs://`, `s3://`, `memory://`).
    - **chief only**: only the chief process writes, locks and deletes; every process
      restores.
    - **Keras's backups**: a `backup_dir` written by `keras.callbacks.BackupAndRestore`
      (`latest.weights.h5`, `training_metadata.json`, their `.bkp` copies) is resumed from,
      with a warning: its weights, optimizer state and epoch, from the start of that epoch
      as Keras would. The next backup replaces its files. Both kinds in one directory are
      an error naming them. Keras's `_current_epoch`, `_last_batch_seen`, `_weights_path`
      and `_training_metadata_path` (and `_prev_` ones) exist here too, the paths naming
      the newest (and second newest) complete backup's files, None before there is one.

    The callback does not need `fit`: a custom loop can call `set_model`, `set_params`
    (`{"epochs": ..., "steps": ...}`) and the `on_*` hooks, or `save(epoch, batch)` and
    `restore()` directly.

    Args:
        backup_dir: directory (path or URL) for the backups; it must not be shared with
            other runs or other callbacks.
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

    Example:

    >>> import keras, numpy as np
    >>> from keras_accel.callbacks import BackupAndRestore
    >>> class Interrupt(keras.callbacks.Callback):
    ...     def on_epoch_begin(self, epoch, logs=None):
    ...         if epoch == 2:
    ...             raise RuntimeError("interrupted")
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> x, y = np.ones((8, 2)), np.ones((8, 1))
    >>> backup = BackupAndRestore("memory://doc/backup")
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
    ):
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
        if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
            raise ValueError(
                f"`max_to_keep` must be a positive integer. Received: max_to_keep={max_to_keep!r}"
            )
        if lock_timeout is not None and not lock_timeout > 0:
            raise ValueError(
                "`lock_timeout` must be a positive number of seconds, or None. "
                f"Received: lock_timeout={lock_timeout!r}"
            )
        backup_dir = os.fspath(backup_dir)
        if not io.is_remote(backup_dir):
            backup_dir = os.path.abspath(backup_dir.removeprefix("file://"))
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max(max_to_keep, 2) if double_checkpoint else max_to_keep
        self.lock_timeout = lock_timeout
        self.verbose = verbose
        self._lock = DirectoryLock(backup_dir, lock_timeout, self)
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
        self._replay: dict | None = None  # The checkpoint to re-assign at the replay's end.

    # ------------------------------------------------------------------ hooks
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
        run_state(model).replay_epoch = None
        if process.is_chief():
            self._prepare_directory()
            self._lock.acquire(model)
        try:
            self.restore()
        except BaseException:
            # Leave the directory as it was: nothing saved, nobody locked out.
            self._lock.release()
            self._training = False
            raise

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        self._last_batch_seen = 0

    def on_train_batch_end(self, batch, logs=None):
        state = run_state(self._model)
        if self._replay is not None and state.replaying(self._current_epoch, batch + 1):
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
        if not isinstance(self.save_freq, int) or self.save_freq is False:
            return
        if self._steps_done - self._last_saved < self.save_freq:
            return
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps:
            # The epoch's last batch: save after validation and the epoch's History row.
            self._save_at_epoch_end = True
            return
        self.save(self._current_epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        run_state(self._model).replay_epoch = None
        self._current_epoch, self._last_batch_seen = epoch + 1, 0
        if self.save_freq == "epoch" or self._save_at_epoch_end:
            self._save_at_epoch_end = False
            self.save(epoch + 1, 0, logs=logs, finished_epoch=epoch)

    def on_train_end(self, logs=None):
        self._training = False
        model = self._model
        # Keras never clears the epoch a restore set: a later fit would skip epochs.
        model._initial_epoch = None
        state = run_state(model)
        state.resumed_at = None
        state.replay_epoch = None
        self._replay = None
        if process.is_chief():
            if self.delete_checkpoint:
                self._delete_all()
            self._lock.release()

    # ------------------------------------------------------------------ saving
    def save(
        self, epoch: int, batch: int, logs: dict | None = None, finished_epoch: int | None = None
    ) -> str | None:
        """Back up the state at `batch` batches into `epoch` (batch 0: the epoch's start).

        Returns the backup's path on the chief process, None elsewhere (which write nothing).
        """
        model = self.model
        history = getattr(model, "history", None)
        if finished_epoch is not None and hasattr(history, "finish_epoch"):
            history.finish_epoch(finished_epoch, logs)
        self._last_saved = self._steps_done
        if not process.is_chief():
            return None
        groups = _state.variable_groups(model)
        data, manifest = _state.save_variables(groups)
        steps = (self.params or {}).get("steps")
        state = {
            "format": FORMAT,
            "version": VERSION,
            "epoch": int(epoch),
            "batch": int(batch),
            "steps_done": int(self._steps_done),
            "steps_per_epoch": None if steps is None else int(steps),
            "iterations": _optional_int(getattr(model.optimizer, "iterations", None)),
            "learning_rate": run_state(model).learning_rate,
            "history": history.to_dict() if hasattr(history, "to_dict") else None,
            "rng": _state.rng_state(),
            "manifest": manifest,
            "backend": keras.backend.backend(),
            "keras_version": keras.__version__,
            "time": time.time(),
        }
        files = {VARIABLES: data, STATE: json.dumps(state).encode("utf-8")}
        path = self._write_checkpoint(_checkpoint_name(epoch, batch), files)
        self._rotate()
        self._lock.heartbeat(force=True)
        if self.verbose > 0:
            print_msg(f"\nBackupAndRestore: saved {path}")
        return path

    def _write_checkpoint(self, name: str, files: dict[str, bytes]) -> str:
        final = io.join(self.backup_dir, name)
        temp = io.join(self.backup_dir, f".tmp-{name}-{os.getpid()}-{time.time_ns()}")
        fs = io.filesystem(final)
        io.makedirs(temp)
        try:
            for file_name, data in files.items():
                with io.open(io.join(temp, file_name), "wb") as f:
                    f.write(data)
                fs.fsync_file(io.join(temp, file_name))
            fs.fsync_dir(temp)
            if io.exists(final):
                # A backup of this position exists only if it was skipped as unusable when
                # this run restored an older one; this replaces it.
                io.rmtree(final)
            io.rename(temp, final)
            fs.fsync_dir(self.backup_dir)
        except BaseException:
            _quietly(io.rmtree, temp)
            raise
        # Written last: until it exists, the directory is not a backup.
        marker = {
            "files": {file_name: _sha256(data) for file_name, data in files.items()},
        }
        io.write_atomic(io.join(final, COMMITTED), json.dumps(marker))
        return final

    def _rotate(self) -> None:
        # Runs right after a complete save, under the lock: any directory without a marker
        # is a save that a crash interrupted, and temporary directories are leftovers.
        names = self._checkpoint_names()
        committed = [n for n in names if io.exists(io.join(self.backup_dir, n, COMMITTED))]
        keep = set(committed[-self.max_to_keep :])
        for name in self._listdir():
            if (_NAME.match(name) and name not in keep) or name.startswith(".tmp-ckpt-"):
                _quietly(io.rmtree, io.join(self.backup_dir, name))
            elif name in KERAS_FILES:
                # A Keras backup this run resumed from: the complete backup just written
                # holds a later state, as Keras's own next save would overwrite its file.
                _quietly(io.remove, io.join(self.backup_dir, name))

    def _delete_all(self) -> None:
        for name in self._listdir():
            if _NAME.match(name) or name.startswith(".tmp-ckpt-"):
                _quietly(io.rmtree, io.join(self.backup_dir, name))
            elif name in KERAS_FILES:  # Training finished: Keras would delete them too.
                _quietly(io.remove, io.join(self.backup_dir, name))
        remaining = [n for n in self._listdir() if n != LOCK_NAME]
        self._lock.release()
        if not remaining:
            _quietly(io.rmtree, self.backup_dir)

    # ------------------------------------------------------------------ restoring
    def checkpoints(self) -> list[str]:
        """Paths of the complete backups, oldest first."""
        return [
            io.join(self.backup_dir, name)
            for name in self._checkpoint_names()
            if io.exists(io.join(self.backup_dir, name, COMMITTED))
        ]

    def restore(self) -> bool:
        """Restore the newest usable backup into the model; False if there is none.

        A backup that cannot be read (missing marker, checksum mismatch, damaged file) is
        skipped with a warning. One that does not fit the model raises a ValueError naming
        the variable, as does a change in the number of batches per epoch when the backup
        was taken mid-epoch.
        """
        if not io.isdir(self.backup_dir):
            return False
        names = self._checkpoint_names()
        listed = set(self._listdir())
        keras_files = [name for name in KERAS_FILES if name in listed]
        if keras_files:
            committed = self.checkpoints()
            if committed:
                raise RuntimeError(
                    f"BackupAndRestore: backup_dir {self.backup_dir!r} holds a backup written "
                    f"by keras.callbacks.BackupAndRestore ({', '.join(keras_files)}) and "
                    f"backups written by keras_accel ({', '.join(map(io.basename, committed))})"
                    ", so which one is newer is unclear. Move away the one not to resume from "
                    "(Keras's files, or the ckpt-* directories), or use another backup_dir."
                )
            for name in names:  # keras_accel saves that never completed.
                warnings.warn(
                    f"BackupAndRestore: skipping the incomplete backup "
                    f"{io.join(self.backup_dir, name)!r} (no {COMMITTED} marker: its save was "
                    "interrupted).",
                    stacklevel=2,
                )
            self._restore_keras(keras_files)
            return True
        unusable = []
        for name in reversed(names):
            path = io.join(self.backup_dir, name)
            if not io.exists(io.join(path, COMMITTED)):
                warnings.warn(
                    f"BackupAndRestore: skipping the incomplete backup {path!r} (no "
                    f"{COMMITTED} marker: its save was interrupted); using the one before it.",
                    stacklevel=2,
                )
                continue
            try:
                checkpoint = self._read(path)
            except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
                warnings.warn(
                    f"BackupAndRestore: skipping the unusable backup {path!r} ({e}); "
                    "using the one before it.",
                    stacklevel=2,
                )
                unusable.append(path)
                continue
            self._apply(checkpoint, path)
            return True
        if unusable:
            raise RuntimeError(
                f"BackupAndRestore: none of the backups in {self.backup_dir!r} can be read "
                f"({', '.join(unusable)}). They were left as they are; move them away to "
                "start training from scratch."
            )
        return False

    def _read(self, path: str) -> dict[str, Any]:
        marker = json.loads(io.read_text(io.join(path, COMMITTED)))
        contents = {}
        for file_name, digest in marker["files"].items():
            data = io.read_bytes(io.join(path, file_name))
            if _sha256(data) != digest:
                raise ValueError(f"{file_name} does not match its checksum")
            contents[file_name] = data
        state = json.loads(contents[STATE].decode("utf-8"))
        if state.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} backup (format={state.get('format')!r})")
        arrays = _state.load_variables(contents[VARIABLES], state["manifest"])
        return {"state": state, "arrays": arrays}

    def _apply(self, checkpoint: dict[str, Any], path: str) -> None:
        model = self.model
        state, arrays = checkpoint["state"], checkpoint["arrays"]
        epoch, batch = int(state["epoch"]), int(state["batch"])
        steps = (self.params or {}).get("steps")
        if batch and steps is not None and state.get("steps_per_epoch") not in (None, steps):
            raise ValueError(
                f"The backup {path!r} was taken {batch} batches into epoch {epoch + 1}, with "
                f"{state['steps_per_epoch']} batches per epoch; this fit has {steps}. A "
                "mid-epoch resume needs the same data and batch size. Restore with the "
                "original settings, or use another backup_dir."
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        groups = _state.variable_groups(model)
        _state.check_compatible(groups, state["manifest"], repr(path))
        _state.assign_variables(groups, state["manifest"], arrays, ("model", "optimizer", "seed"))
        _state.set_rng_state(state["rng"])
        history = getattr(model, "history", None)
        if state.get("history") and hasattr(history, "load_dict"):
            history.load_dict(state["history"])
        model._initial_epoch = epoch
        run = run_state(model)
        run.resumed_at = (epoch, batch)
        run.restores += 1
        if batch:
            run.replay_epoch, run.replay_batch = epoch, batch
            self._replay = checkpoint
        self._steps_done = self._last_saved = int(state["steps_done"])
        self._last_batch, self._batch_epoch = batch - 1, epoch
        self._current_epoch, self._last_batch_seen = epoch, max(batch - 1, 0)
        if self.verbose > 0:
            print_msg(f"BackupAndRestore: restored {path} (epoch {epoch + 1}, batch {batch})")

    def _finish_replay(self) -> None:
        """The re-run batches reached the backup's position: assign its state again."""
        checkpoint, self._replay = self._replay, None
        model = self.model  # On JAX, pulls the training state onto the variables first.
        state, arrays = checkpoint["state"], checkpoint["arrays"]
        groups = _state.variable_groups(model)
        _state.assign_variables(groups, state["manifest"], arrays)
        _state.set_rng_state(state["rng"])
        # `replay_epoch` stays set until the epoch ends: callbacks after this one in the
        # list must still see this batch as a replayed one.
        run_state(model).restores += 1

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
        model._initial_epoch = epoch
        run = run_state(model)
        run.resumed_at = (epoch, 0)
        run.restores += 1
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
            "backup is written in keras_accel's layout (ckpt-* directories) and replaces "
            "these files.",
            stacklevel=2,
        )

    def _load_keras(self, weights: str | None, metadata: str | None) -> tuple[int, int]:
        """Load one Keras weights/metadata pair; `(epoch, batch)` from the metadata."""
        model = self.model
        epoch = batch = 0
        if metadata is not None:
            record = json.loads(io.read_text(io.join(self.backup_dir, metadata)))
            epoch, batch = int(record["epoch"]), int(record.get("batch", 0))
        if weights is not None:
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)  # Its variables are saved too.
            with io.local_copy(io.join(self.backup_dir, weights)) as local:
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
    # they name the files of the newest and second-newest complete backup (the variables
    # and the state, which holds the epoch and batch), or are None where there is none.
    @property
    def _weights_path(self) -> str | None:
        return self._backup_file(1, VARIABLES)

    @property
    def _training_metadata_path(self) -> str | None:
        return self._backup_file(1, STATE)

    @property
    def _prev_weights_path(self) -> str | None:
        return self._backup_file(2, VARIABLES)

    @property
    def _prev_training_metadata_path(self) -> str | None:
        return self._backup_file(2, STATE)

    def _backup_file(self, newest: int, name: str) -> str | None:
        complete = self.checkpoints()
        return io.join(complete[-newest], name) if len(complete) >= newest else None

    # ------------------------------------------------------------------ directory
    def _prepare_directory(self) -> None:
        path = self.backup_dir
        try:
            if io.exists(path) and not io.isdir(path):
                raise NotADirectoryError(
                    f"BackupAndRestore: backup_dir {path!r} is a file, not a directory. "
                    "Point backup_dir at a directory (it is created if missing)."
                )
            io.makedirs(path)
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
            return io.listdir(self.backup_dir)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _checkpoint_names(self) -> list[str]:
        """Backup directory names, oldest first (the names sort by position)."""
        return sorted(name for name in self._listdir() if _NAME.match(name))


def _checkpoint_name(epoch: int, batch: int) -> str:
    return f"ckpt-e{epoch:06d}-b{batch:08d}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _optional_int(value) -> int | None:
    if value is None:
        return None
    try:
        return int(value.numpy() if hasattr(value, "numpy") else value)
    except (TypeError, ValueError):
        return None


def _quietly(function, *args) -> None:
    with contextlib.suppress(OSError, ValueError):
        function(*args)
