"""`ModelCheckpoint`: Keras's callback, writing to your path from the chief only, rotated."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import keras
import numpy as np

from keras_accel.adapter.protocol import run_context
from keras_accel.callbacks import _saving
from keras_accel.state import files
from keras_accel.utils import keras_internals, process
from keras_accel.utils.printing import print_msg


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Saves the model (or its weights) during training; Keras's, plus rotation.

    Takes every argument of `keras.callbacks.ModelCheckpoint` with the same meaning
    (`monitor`, `save_best_only`, `mode`, `save_weights_only`, `save_freq`,
    `initial_value_threshold`, `{epoch}`/`{batch}`/`{val_loss:.2f}` placeholders in
    `filepath`), and adds:

    - `max_to_keep`: keep only the newest N files this pattern produced (like the seed's
      `CheckpointManager(max_to_keep=5)`); older matching files in the directory, from
      earlier runs too, are deleted. `None` (default) keeps everything, as Keras does;
    - only the chief process writes to `filepath` (every process still tracks the best
      value, so they agree on it); in Keras every process of a multi-process run writes
      there. The others save too (reading the state can be a collective), into a local
      temporary directory deleted as soon as the file is written;
    - any path: a local path or a URL (`gs://`, `s3://`, `memory://`). Keras writes a
      local temporary file, which is renamed (local) or uploaded (URL) over the target,
      so a crash never leaves a half-written file under the final name;
    - batches that `BackupAndRestore` replays after a mid-epoch resume are not saved, and
      `best` (what `save_best_only` compares with) is saved with each backup and restored
      with it: a resumed run keeps only what beats the best of the run before.

    `.keras` files load back with `keras.saving.load_model(path)` in Keras's safe mode; for
    a URL, fetch it with `keras_accel.state.files.local_copy(path)` first.

    Args:
        filepath: path or URL of the file; ends in `.keras` (whole model), or
            `.weights.h5` with `save_weights_only=True`.
        max_to_keep: how many files to keep, or None for all.
        (others): as in `keras.callbacks.ModelCheckpoint`.

    Example:

    >>> import keras, numpy as np
    >>> from keras_accel.state import files
    >>> from keras_accel.callbacks import ModelCheckpoint
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> checkpoint = ModelCheckpoint("memory://doc/ckpt/e{epoch}.weights.h5",
    ...                              save_weights_only=True, max_to_keep=2)
    >>> _ = model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=3, verbose=0,
    ...               callbacks=[checkpoint])
    >>> files.listdir("memory://doc/ckpt")
    ['e2.weights.h5', 'e3.weights.h5']
    """

    def __init__(
        self,
        filepath,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq="epoch",
        initial_value_threshold: float | None = None,
        max_to_keep: int | None = None,
    ):
        # The Keras internals our callbacks rely on, checked once, under a plain model.fit too.
        keras_internals.check()
        super().__init__(
            filepath,
            monitor=monitor,
            verbose=verbose,
            save_best_only=save_best_only,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
            initial_value_threshold=initial_value_threshold,
        )
        if max_to_keep is not None and (
            not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1
        ):
            raise ValueError(
                "`max_to_keep` must be a positive integer, or None to keep every file. "
                f"Received: max_to_keep={max_to_keep!r}"
            )
        self.max_to_keep = max_to_keep
        self._kept: list[str] | None = None
        self._epoch: int | None = None  # Kept here: Keras's own (`_current_epoch`) is private.
        self._ended: int | None = None  # The last epoch whose end this callback has seen.
        # Its state's key in a backup: one per file pattern, so that several checkpoints of
        # one fit (weights and whole model, say) each get their own `best` back.
        self.state_key = f"ModelCheckpoint:{self.filepath}"

    def fusion_period(self, kind: str, steps: int | None) -> int | None:
        """Host-loop fusion (`keras_accel.adapter.protocol`): Keras counts `save_freq=N`
        in batch hooks, one per host call, so that needs every batch; "epoch" takes any."""
        return None if kind != "train" or self.save_freq == "epoch" else 1

    def set_model(self, model):
        # The Keras internals read on the model and its optimizer: checked before any step.
        keras_internals.check_model(model)
        super().set_model(model)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._ended = epoch

    def state_dict(self) -> dict:
        """`best`, the monitored value of the file `save_best_only` kept last, for
        `BackupAndRestore` to save with each backup (`keras_accel.adapter.protocol`): a
        resumed run saves only what beats it, as the uninterrupted run would.

        A backup taken at an epoch's end before this callback's `on_epoch_end` ran (the
        backup's callback first) holds the best including that epoch, which this callback
        is about to save by Keras's rule."""
        best = self.best
        ending = run_context(self._model).epoch_end if self._model is not None else None
        if ending is not None and self.save_best_only and self.save_freq == "epoch":
            epoch, logs = ending
            current = (logs or {}).get(self.monitor)
            pending = epoch != self._ended and current is not None and np.ndim(current) == 0
            if pending and keras_internals.monitor_improves(self, current, best):
                best = current
        return {"best": None if best is None else float(best)}

    def load_state_dict(self, state: dict) -> None:
        """Go on from the `best` a backup saved."""
        self.best = state.get("best", self.best)

    def on_train_batch_end(self, batch, logs=None):
        if run_context(self._model).replaying(self._epoch, batch):
            return
        super().on_train_batch_end(batch, logs)

    def _save_model(self, epoch, batch, logs):
        filepath = self._get_file_path(epoch, batch, logs)
        # Every process decides (and updates `best`), so all agree; only the chief writes.
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        chief = process.is_chief()
        # Every process saves: reading the state can be a collective (a TF variable synced
        # on read; a variable that Keras lays out anew), which all processes must join. The
        # others write a scratch copy, removed at once (TensorFlow's multi-worker recipe).
        scratch = None if chief else tempfile.mkdtemp(prefix="keras-accel-")
        target = filepath if chief else os.path.join(scratch, files.basename(filepath))
        try:
            _saving.save(self.model, target, weights_only=self.save_weights_only)
        except IsADirectoryError as e:
            # Keras's wording (it raises an IOError here too), then ours.
            raise IsADirectoryError(
                "Please specify a non-directory filepath for ModelCheckpoint. Filepath used "
                f"is an existing directory: {filepath}. {e}"
            ) from e
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        if not chief:
            return
        if self.verbose > 0:
            print_msg(f"\nEpoch {epoch + 1}: finished saving model to {filepath}")
        self._rotate(filepath)

    def _rotate(self, saved: str) -> None:
        if self.max_to_keep is None:
            return
        if self._kept is None:
            self._kept = self._existing_files()
        if saved in self._kept:
            self._kept.remove(saved)
        self._kept.append(saved)
        while len(self._kept) > self.max_to_keep:
            old = self._kept.pop(0)
            if files.exists(old):
                files.remove(old)

    def _existing_files(self) -> list[str]:
        """Files in the directory that this pattern could have written, oldest first."""
        directory, pattern = files.dirname(self.filepath), files.basename(self.filepath)
        if not directory or not files.isdir(directory):
            return []
        regex = re.compile(_pattern_regex(pattern))
        found = [
            files.join(directory, name) for name in files.listdir(directory) if regex.match(name)
        ]
        # Oldest first by modification time where the storage has one, then by name.
        return sorted(found, key=lambda path: (files.getmtime(path) or 0.0, path))


def _pattern_regex(pattern: str) -> str:
    """A regex matching what `pattern.format(...)` can produce: placeholders match `.+`."""
    parts = re.split(r"\{[^{}]*\}", pattern)
    return "^" + ".+".join(re.escape(part) for part in parts) + "$"
