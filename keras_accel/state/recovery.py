"""Restoring from a directory of backups: find what it holds, check every candidate against
the sizes and CRC32Cs its commit recorded, set damaged steps aside, and restore the newest
intact one; refuse what this engine cannot resume from, naming it.

`keras_accel.callbacks.BackupAndRestore` applies what is restored to the fit; the words
every engine shares for a damaged or missing backup are `keras_accel.state.faults`'.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import keras

from keras_accel.state import checksums, faults, keras_backups, record
from keras_accel.state.backups import Backups
from keras_accel.utils import process


def survey(backups: Backups) -> tuple[list[str], list[int]]:
    """`(Keras's backup files, the committed steps)` in the directory, after any save of
    this process is on disk. A save that a kill interrupted is named in a warning; a
    directory of another engine's backups, or of both Keras's and ours, is refused."""
    listed = set(backups.listdir())
    keras_files = [name for name in keras_backups.FILES if name in listed]
    engine = backups.open()
    engine.wait()
    steps = engine.steps()
    _warn_interrupted(backups, engine, steps)
    _check_layout(backups, listed, steps)
    if keras_files and steps:
        raise RuntimeError(
            f"BackupAndRestore: backup_dir {backups.directory!r} holds a backup written "
            f"by keras.callbacks.BackupAndRestore ({', '.join(keras_files)}) and "
            f"backups written by keras_accel (steps {steps}), so which one is newer "
            "is unclear. Move away the one not to resume from, or use another "
            "backup_dir."
        )
    return keras_files, steps


def restore_newest(
    backups: Backups, steps: list[int], fit: Callable[[dict, str], dict], model
) -> tuple[dict, dict, str] | None:
    """Restore the newest intact of the committed `steps`: `(its record, the variables
    restored, its path)`, or None where there is none.

    Each backup's files are checked first; `fit(record, path)` then gives the variables to
    restore into (and raises where the backup does not fit the model). A damaged backup is
    set aside under `damaged/` once an older one restores; one that cannot be read for
    another reason is skipped with a warning. None intact raises naming each. `model`: for
    the barriers of several processes.
    """
    engine = backups.open()
    unusable = []  # (step, path, why): passed over, none restored yet.
    damaged = []  # (step, checksums.Damaged): set aside once an intact one restores.
    for step in reversed(steps):
        path = engine.path(step)
        try:
            # Every file against the sizes and CRC32Cs its commit recorded, before
            # anything of it is read (tf.train checks its own as it reads).
            engine.verify(step)
            meta = engine.read_meta(step)
            record.check_format(meta)
        except checksums.Damaged as damage:
            damaged.append((step, damage))
            unusable.append((step, path, str(damage)))
            continue
        except Exception as error:  # Whatever the engine raises for a damaged record.
            _skip(path, error)
            unusable.append((step, path, f"{type(error).__name__}: {str(error)[:300]}"))
            continue
        chosen = fit(meta, path)
        try:
            engine.restore(step, chosen, meta["manifest"])
        except checksums.Damaged as damage:
            damaged.append((step, damage))
            unusable.append((step, path, str(damage)))
            continue
        except Exception as error:
            _skip(path, error)
            unusable.append((step, path, f"{type(error).__name__}: {str(error)[:300]}"))
            continue
        _set_aside(backups, engine, damaged, step, model)
        return meta, chosen, path
    if unusable:
        raise faults.none_intact_error(backups.directory, unusable)
    return None


def _set_aside(backups: Backups, engine, damaged: list, intact: int, model) -> None:
    """Move the damaged steps found newer than the restored step `intact` out of the
    engine's listing (kept under `damaged/`, never resumed from or counted as the latest
    again), each with a warning naming the step, the file and what differs. Across
    processes every one has read them before the chief moves them (a barrier), and none
    goes on before they are gone."""
    if not damaged:
        return
    several = process.num_processes() > 1
    if several:
        process.barrier("keras_accel.BackupAndRestore.damaged", model)
    for step, damage in damaged:
        where, why = None, ""
        try:
            where = engine.set_aside(step)
        except Exception as error:  # The warning says so; the restore goes on.
            why = f"{type(error).__name__}: {error}"
        warnings.warn(
            faults.damaged_warning(backups.directory, step, damage, where, why, intact),
            stacklevel=5,
        )
    if several:
        process.barrier("keras_accel.BackupAndRestore.set_aside", model)


def _warn_interrupted(backups: Backups, engine, steps: list[int]) -> None:
    """A save that never committed is no backup, but a run never drops one silently."""
    interrupted, engine.interrupted = list(getattr(engine, "interrupted", [])), []
    if not interrupted:
        return
    which = ", ".join(str(step) for step in interrupted)
    warnings.warn(
        f"BackupAndRestore: the backup of step {which} in {backups.directory!r} was still "
        "being written when its process ended (killed, or gone before the save finished), "
        f"so {backups.module.NAME} never committed it; its partial files are removed. "
        + (
            f"Resuming from the complete backups (steps {steps}), newest first."
            if steps
            else "There is no complete backup: training starts from the beginning."
        ),
        stacklevel=4,
    )


def _skip(path: str, error: Exception) -> None:
    warnings.warn(
        f"BackupAndRestore: skipping the unusable backup {path!r} "
        f"({type(error).__name__}: {str(error)[:300]}); using the one before it.",
        stacklevel=4,
    )


def _check_layout(backups: Backups, listed: set[str], steps: list[int]) -> None:
    """A directory of another format is refused with what it is, never ignored."""
    if steps:
        return
    name = backups.module.NAME
    old = sorted(entry for entry in listed if entry.startswith("ckpt-e") and "-b" in entry)
    other = None
    if old:
        other = f"keras_accel 0.1's npz backups ({', '.join(old[:3])})"
    elif name != "orbax" and any(entry.isdigit() for entry in listed):
        other = "Orbax checkpoints (numbered directories: written on KERAS_BACKEND=jax)"
    elif name != "orbax" and _staged(listed, "orbax"):
        other = "Orbax checkpoints (orbax-<step> prefixes: written on KERAS_BACKEND=jax)"
    elif name != "tf.train" and _staged(listed, "tf"):
        other = "tf.train checkpoints (tf-<step> prefixes: written on KERAS_BACKEND=tensorflow)"
    elif name != "tf.train" and "checkpoint" in listed:
        other = "tf.train checkpoints (written on KERAS_BACKEND=tensorflow)"
    elif name != "torch.distributed.checkpoint" and any(
        entry.startswith("dcp-") and entry[4:].isdigit() for entry in listed
    ):
        other = (
            "torch.distributed.checkpoint checkpoints (dcp-<step> directories: written "
            "on KERAS_BACKEND=torch)"
        )
    if other:
        raise RuntimeError(
            f"BackupAndRestore: backup_dir {backups.directory!r} holds {other}, which "
            f"{name} on KERAS_BACKEND={keras.backend.backend()} cannot "
            "resume from. Resume with the backend that wrote them, or move them away to "
            "start from scratch."
        )


def _staged(names: set[str], tag: str) -> bool:
    """Whether `names` hold staged checkpoints `<tag>-<step>` (keras_accel.state.staged)."""
    return any(name.startswith(f"{tag}-") and name[len(tag) + 1 :].isdigit() for name in names)
