"""The JSON record every backup commits with its arrays: what no engine stores (epoch and
batch, the callbacks' states, the random generator states, the variable manifest, the
versions), and the checks a restore makes of it before anything is restored."""

from __future__ import annotations

import time

import keras

from keras_accel.state import tree

FORMAT = "keras_accel.BackupAndRestore"
# 3: the states of the fit's callbacks under "callbacks" ({state key: state_dict()}); version
# 2 kept the History record alone, under "history" (still restored).
VERSION = 3


def build(
    model,
    state: dict,
    epoch: int,
    batch: int,
    steps_done: int,
    steps_per_epoch: int | None,
    learning_rate: float | None,
    callbacks: dict,
    engine: str,
) -> dict:
    """The record of a backup of `state` (`tree.variables(model)`) at `batch` batches into
    `epoch`; `callbacks` the fit's callbacks' states, `engine` the engine's name."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "epoch": int(epoch),
        "batch": int(batch),
        "steps_done": int(steps_done),
        "steps_per_epoch": None if steps_per_epoch is None else int(steps_per_epoch),
        "iterations": _optional_int(getattr(model.optimizer, "iterations", None)),
        "learning_rate": learning_rate,
        "callbacks": callbacks,
        "rng": tree.rng_state(),
        "manifest": tree.manifest(state),
        "backend": keras.backend.backend(),
        "engine": engine,
        "keras_version": keras.__version__,
        "keras_accel_version": _version(),
        "time": time.time(),
    }


def check_format(meta: dict) -> None:
    """A record of another kind is no backup of ours: refused as unusable."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} backup (format={meta.get('format')!r})")


def check_version(meta: dict, path: str) -> None:
    """A backup of a later format is refused before anything is restored from it."""
    version = meta.get("version", 1)
    if isinstance(version, int) and version > VERSION:
        raise ValueError(
            f"BackupAndRestore: the backup {path!r} is of format version {version}, "
            f"written by keras_accel {meta.get('keras_accel_version', '?')}; this "
            f"keras_accel reads versions up to {VERSION}. Upgrade keras_accel to resume "
            "from it, or point backup_dir elsewhere to start afresh."
        )


def check_steps(meta: dict, path: str, steps_per_epoch: int | None) -> None:
    """A backup taken mid-epoch resumes only with the same number of batches per epoch."""
    epoch, batch = int(meta["epoch"]), int(meta["batch"])
    steps = steps_per_epoch
    if batch and steps is not None and meta.get("steps_per_epoch") not in (None, steps):
        raise ValueError(
            f"The backup {path!r} was taken {batch} batches into epoch {epoch + 1}, with "
            f"{meta['steps_per_epoch']} batches per epoch; this fit has {steps}. A "
            "mid-epoch resume needs the same data and batch size. Restore with the "
            "original settings, or use another backup_dir."
        )


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
