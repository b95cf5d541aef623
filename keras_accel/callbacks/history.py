"""`History`: Keras's record of training, kept on disk and carried across a resume."""

from __future__ import annotations

import csv as _csv
import io
import json
import os
import time
from typing import Any

import keras
import numpy as np

from keras_accel.adapter.protocol import run_context
from keras_accel.callbacks._run import run_state
from keras_accel.callbacks.learning_rate import host_step, optimizer_rate
from keras_accel.state import files, outputs
from keras_accel.utils import keras_internals, process
from keras_accel.utils.optimizers import inner_optimizer

FORMAT = "keras_accel.History"
VERSION = 1
# Columns this callback adds to what the logs hold.
EXTRA_COLUMNS = ("epoch_time", "samples_per_second", "learning_rate")


class History(keras.callbacks.History):
    """Records every epoch's logs, like Keras's `History`, and keeps them safe on disk.

    A drop-in for `keras.callbacks.History`: `.history` is a dict of lists (one value per
    epoch), `.epoch` the list of epoch indices, `model.history` is this object, and `fit`
    returns it when it is in the callbacks. It adds:

    - per-epoch `epoch_time` (wall seconds), `samples_per_second` (rows the loss saw
      over the training part of the epoch: under `Accelerator.fit` the real rows, padding
      excluded) and `learning_rate` (the rate of the epoch's
      last step, read from the optimizer);
    - with `per_step=True`, every batch's logs in `.steps` (a list of dicts);
    - with `path`, a JSON file (and a CSV one with `csv=True`) rewritten atomically after
      every epoch by the chief process only, so whatever finished survives a crash, a
      KeyboardInterrupt or a SIGKILL; `History.load(path)` reads it back;
    - on resume it continues the same record: a fit that starts at epoch `e` (from
      `initial_epoch`, or restored by `BackupAndRestore`, which saves and restores this
      record through `state_dict`/`load_state_dict`) keeps epochs before `e` and replaces
      the rest, so no epoch is missing or doubled;
    - `plot(path)` draws loss, metrics and learning rate against epochs to a PNG.

    One difference from Keras: the record is keyed by epoch index. Keras's `History` reused
    across two `fit` calls that both start at epoch 0 appends to its lists; this one
    replaces the first run's epochs (the resume rule above).

    Args:
        path: where to write the JSON record (a local path or a URL such as
            `gs://bucket/run/history.json`); None keeps it in memory only. An existing file
            is read at the start of training and continued.
        csv: True to also write a CSV of the epochs next to it (`path` with `.csv` for its
            `.json` suffix), or the CSV's own path or URL.
        per_step: also record the logs of every training batch.

    Example:

    >>> import keras, numpy as np
    >>> from keras_accel.callbacks import History
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> history = History(path="memory://doc/history.json")
    >>> _ = model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=2, verbose=0,
    ...               callbacks=[history])
    >>> History.load("memory://doc/history.json").epoch
    [0, 1]
    >>> sorted(history.history)
    ['epoch_time', 'learning_rate', 'loss', 'samples_per_second']
    """

    def __init__(self, path: str | None = None, csv: bool | str = False, per_step: bool = False):
        # The Keras internals our callbacks rely on, checked once, under a plain model.fit too.
        keras_internals.check()
        super().__init__()
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"`path` must be a path or URL string, or None. Received: path={path!r}"
            )
        if csv and path is None and not isinstance(csv, (str, os.PathLike)):
            raise ValueError(
                "csv=True writes the CSV next to `path`, but no path was given. Pass "
                "path='history.json' or csv='history.csv'."
            )
        self.path = None if path is None else os.fspath(path)
        self.csv = csv
        self.per_step = bool(per_step)
        self.rows: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self.history: dict[str, list] = {}
        self.epoch: list[int] = []
        # Steps per host call of the last fit (host-loop fusion; None before any fit).
        self.steps_per_execution: int | None = None
        self._first_epoch_seen = False
        self._epoch_start = None
        self._epoch = None
        self._train_time = None
        self._samples = None

    # ------------------------------------------------------------------ protocol
    def fusion_period(self, kind: str, steps: int | None) -> int | None:
        """Host-loop fusion (`keras_accel.adapter.protocol`): per-step records need a host
        call per training step; epoch records take any fusion."""
        return 1 if self.per_step and kind == "train" else None

    def state_dict(self) -> dict[str, Any]:
        """The record, for `BackupAndRestore` to save with a backup (`to_dict()`).

        A backup taken at the end of an epoch whose `on_epoch_end` this History has not
        seen yet (the backup's callback runs first) holds that epoch too: the run context
        says which epoch ended, with its logs (`RunContext.epoch_end`).
        """
        ending = run_context(self._model).epoch_end if self._model is not None else None
        if ending is not None:
            self.finish_epoch(*ending)
        return self.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the record a backup saved (`load_dict`)."""
        self.load_dict(state)

    # ------------------------------------------------------------------ record
    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-able data (what `path` holds)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "steps_per_execution": self.steps_per_execution,
            "epochs": [dict(row) for row in self.rows],
            "steps": [dict(row) for row in self.steps],
        }

    def load_dict(self, record: dict[str, Any]) -> None:
        """Replace the record by one from `to_dict` (what BackupAndRestore restores)."""
        if record.get("format") != FORMAT:
            raise ValueError(
                f"Not a keras_accel History record: format={record.get('format')!r}, "
                f"expected {FORMAT!r}."
            )
        self.rows = [dict(row) for row in record.get("epochs", [])]
        self.steps = [dict(row) for row in record.get("steps", [])]
        self.steps_per_execution = record.get("steps_per_execution")
        self._rebuild()

    @classmethod
    def load(cls, path: str) -> History:
        """A History holding the record written at `path` (a local path or a URL).

        Raises:
            FileNotFoundError: nothing at `path`.
            ValueError: the file is not a History record.
        """
        path = os.fspath(path)
        try:
            record = json.loads(files.read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path!r} is not a History JSON file: {e}") from e
        history = cls(path=path)
        history.load_dict(record)
        return history

    def _rebuild(self) -> None:
        """`.history` and `.epoch` from the rows, the way Keras lays them out."""
        self.epoch = [int(row["epoch"]) for row in self.rows]
        columns: dict[str, list] = {}
        for row in self.rows:
            for key, value in row.items():
                if key != "epoch":
                    columns.setdefault(key, []).append(value)
        self.history = columns

    def _truncate(self, first_epoch: int) -> None:
        """Drop what a fit starting at `first_epoch` is about to record again."""
        resumed = run_context(self._model).resumed_at if self._model is not None else None
        keep_batches = resumed[1] if resumed and resumed[0] == first_epoch else 0
        self.rows = [row for row in self.rows if row["epoch"] < first_epoch]
        self.steps = [
            row
            for row in self.steps
            if row["epoch"] < first_epoch
            or (row["epoch"] == first_epoch and row["batch"] < keep_batches)
        ]
        self._rebuild()

    # ------------------------------------------------------------------ hooks
    def set_model(self, model):
        # The Keras internals read on the model and its optimizer: checked before any step.
        keras_internals.check_model(model)
        super().set_model(model)

    def on_train_begin(self, logs=None):
        self._first_epoch_seen = False
        self.steps_per_execution = int(getattr(self._model, "steps_per_execution", 1) or 1)
        # A new process continuing a run: pick up what the last one wrote (unless
        # BackupAndRestore already restored the record from its checkpoint).
        if self.path and not self.rows and not self.steps and files.exists(self.path):
            self.load_dict(json.loads(files.read_text(self.path)))

    def on_epoch_begin(self, epoch, logs=None):
        if not self._first_epoch_seen:
            self._truncate(epoch)
            self._first_epoch_seen = True
        self._epoch = epoch
        self._epoch_start = time.perf_counter()
        self._train_time = None
        self._samples = None

    def on_train_batch_end(self, batch, logs=None):
        steps = (self.params or {}).get("steps")
        if steps and batch + 1 >= steps and self._epoch_start is not None:
            # The epoch's training is over: count its rows now, before validation resets
            # the loss tracker.
            self._train_time = time.perf_counter() - self._epoch_start
            self._samples = _samples_seen(self.model)
        if not self.per_step:
            return
        if run_context(self._model).replaying(self._epoch, batch):
            return
        row = {"epoch": self._epoch, "batch": int(batch)}
        if steps and self._epoch is not None:
            row["step"] = self._epoch * int(steps) + int(batch)
        row.update(_plain(logs))
        rate = run_state(self._model).learning_rate
        if "learning_rate" not in row and rate is not None:
            row["learning_rate"] = rate
        self.steps.append(row)

    def on_epoch_end(self, epoch, logs=None):
        self.finish_epoch(epoch, logs)
        self.model.history = self
        self.write()

    # ------------------------------------------------------------------ epoch rows
    def finish_epoch(self, epoch: int, logs: dict | None = None) -> None:
        """Record epoch `epoch`; calling it again for the same epoch adds new log keys.

        `on_epoch_end` calls it, and `state_dict()` when a backup at the epoch's end comes
        first, so the saved record holds that epoch whichever order the callbacks run in.
        """
        logs = _plain(logs)
        if self.rows and self.rows[-1]["epoch"] == epoch:
            self.rows[-1].update({k: v for k, v in logs.items() if k not in self.rows[-1]})
            self._rebuild()
            return
        row: dict[str, Any] = {"epoch": int(epoch)}
        row.update(logs)
        elapsed = None if self._epoch_start is None else time.perf_counter() - self._epoch_start
        row["epoch_time"] = elapsed
        # Rows over the training part of the epoch (validation excluded), when the epoch's
        # length is known; otherwise over the whole epoch.
        samples = self._samples if self._samples is not None else _samples_seen(self._model)
        seconds = self._train_time or elapsed
        row["samples_per_second"] = samples / seconds if samples is not None and seconds else None
        if "learning_rate" not in row:
            row["learning_rate"] = _last_learning_rate(self._model)
        self.rows.append(row)
        self._rebuild()

    # ------------------------------------------------------------------ files
    @property
    def csv_path(self) -> str | None:
        if not self.csv:
            return None
        if isinstance(self.csv, (str, os.PathLike)):
            return os.fspath(self.csv)
        stem = self.path[: -len(".json")] if self.path.endswith(".json") else self.path
        return f"{stem}.csv"

    def write(self) -> None:
        """Write the record (and CSV) atomically; only the chief process writes."""
        if not process.is_chief():
            return
        if self.path:
            outputs.write(self.path, json.dumps(self.to_dict(), indent=1))
        if self.csv_path:
            outputs.write(self.csv_path, self.to_csv())

    def to_csv(self) -> str:
        """The epochs as CSV text: one row per epoch, one column per key."""
        columns: list[str] = []
        for row in self.rows:
            columns.extend(key for key in row if key not in columns)
        buffer = io.StringIO()
        writer = _csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for row in self.rows:
            writer.writerow({key: "" if row.get(key) is None else row[key] for key in columns})
        return buffer.getvalue()

    def plot(self, path: str) -> str:
        """Draw loss, every metric and the learning rate against epochs, to a PNG.

        Training and `val_` curves of a metric share one panel. Needs matplotlib
        (`pip install matplotlib`, or the `plot` extra of keras_accel).

        Args:
            path: the PNG to write: a local path (its directory is created) or a URL such
                as `gs://bucket/run/curves.png` (drawn in memory, written whole). A `.svg`
                or `.pdf` name gets that format.

        Returns:
            `path`.
        """
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            from matplotlib import pyplot
        except ImportError as e:
            raise ImportError(
                "History.plot needs matplotlib, which is not installed. Install it with "
                "`pip install matplotlib` (or `pip install keras-accel[plot]`)."
            ) from e
        if not self.rows:
            raise ValueError("Nothing to plot: the History has no epochs yet.")
        panels = _panels(self.rows)
        figure, axes = pyplot.subplots(
            len(panels), 1, figsize=(6, 2.6 * len(panels)), sharex=True, squeeze=False
        )
        for axis, (title, keys) in zip(axes[:, 0], panels):
            for key in keys:
                points = [(r["epoch"], r[key]) for r in self.rows if _is_number(r.get(key))]
                if points:
                    xs, ys = zip(*points)
                    axis.plot(xs, ys, marker="o", label=key)
            axis.set_ylabel(title)
            axis.grid(alpha=0.3)
            if len(keys) > 1:
                axis.legend()
        axes[-1, 0].set_xlabel("epoch")
        figure.tight_layout()
        path = os.fspath(path)
        try:
            outputs.write_figure(path, figure, dpi=100)
        finally:
            pyplot.close(figure)
        return path


def _panels(rows: list[dict]) -> list[tuple[str, list[str]]]:
    keys: list[str] = []
    for row in rows:
        keys.extend(key for key in row if key not in keys)
    skip = {"epoch", "epoch_time", "samples_per_second", "learning_rate"}
    bases = [k for k in keys if k not in skip and not k.startswith("val_")]
    bases += [k[4:] for k in keys if k.startswith("val_") and k[4:] not in bases]
    panels = [(base, [k for k in (base, f"val_{base}") if k in keys]) for base in bases]
    if "learning_rate" in keys:
        panels.append(("learning_rate", ["learning_rate"]))
    return panels


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def _plain(logs: dict | None) -> dict[str, Any]:
    """Logs as JSON-able Python values (Keras hands over floats; tensors are converted)."""
    plain = {}
    for key, value in (logs or {}).items():
        if isinstance(value, (bool, int, float, str)) or value is None:
            plain[key] = value
            continue
        array = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
        plain[key] = array.item() if array.size == 1 else array.tolist()
    return plain


def _samples_seen(model) -> float | None:
    """Rows the compiled loss saw this epoch: Keras weights its loss tracker by batch rows."""
    if model is None:
        return None  # A record written without a fit (`finish_epoch` called directly).
    tracker = keras_internals.loss_tracker(model)
    count = getattr(tracker, "count", None)
    if count is None:
        return None
    try:
        return float(np.asarray(count.numpy()))
    except (TypeError, ValueError, AttributeError):
        return None


def _last_learning_rate(model) -> float | None:
    """The rate of the last optimizer step (a variable's value, or a schedule at step - 1)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    try:
        step = max(host_step(inner_optimizer(optimizer).iterations) - 1, 0)
        return optimizer_rate(optimizer, step)
    except (TypeError, ValueError):
        return None
