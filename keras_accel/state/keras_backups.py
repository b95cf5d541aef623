"""Resuming from what `keras.callbacks.BackupAndRestore` wrote into a backup_dir: its weights
(with the optimizer's variables) and `{"epoch": ..., "batch": ...}`, and with
`double_checkpoint=True` the previous pair as `.bkp` copies, loaded as Keras would."""

from __future__ import annotations

import json
import os
import tempfile

from keras_accel.state import files

WEIGHTS = "latest.weights.h5"
METADATA = "training_metadata.json"
FILES = (WEIGHTS, METADATA, f"{WEIGHTS}.bkp", f"{METADATA}.bkp")


def load(model, backup_dir: str, found: list[str]) -> tuple[int, int]:
    """Load the Keras backup whose files `found` lie in `backup_dir` into `model`;
    `(epoch, batch)` from its metadata.

    Its backup holds the weights with the optimizer's variables and the epoch to start at
    (no metric totals, random states or History record). As in Keras, a backup that fails to
    load falls back to the `.bkp` pair of `double_checkpoint=True`.
    """
    pairs = [(WEIGHTS, METADATA), (f"{WEIGHTS}.bkp", f"{METADATA}.bkp")]
    failures = []
    for weights, metadata in pairs:
        if weights not in found and metadata not in found:
            continue
        try:
            return _load_pair(
                model,
                backup_dir,
                weights if weights in found else None,
                metadata if metadata in found else None,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            failures.append(f"{weights}: {type(e).__name__}: {e}")
    raise RuntimeError(
        f"BackupAndRestore: backup_dir {backup_dir!r} holds a backup written by "
        f"keras.callbacks.BackupAndRestore ({', '.join(found)}), but it cannot be "
        f"loaded into this model: {'; '.join(failures)}. Resume it with the model it "
        "was saved from, or move the files away to start from scratch."
    )


def resume_warning(backup_dir: str, found: list[str], epoch: int, batch: int) -> str:
    """What a resume from Keras's backup says: from the start of its epoch, as Keras would."""
    inside = (
        f" It was taken {batch + 1} batches into epoch {epoch + 1}: Keras's backups do "
        "not record enough to resume inside an epoch, so that epoch starts again from "
        "its first batch, as with Keras's callback."
        if batch
        else ""
    )
    return (
        f"BackupAndRestore: resuming from a backup written by "
        f"keras.callbacks.BackupAndRestore in {backup_dir!r} ({', '.join(found)}): "
        f"the weights and optimizer state, starting at epoch {epoch + 1}.{inside} The next "
        "backup is written by the engine and replaces "
        "these files."
    )


def _load_pair(
    model, backup_dir: str, weights: str | None, metadata: str | None
) -> tuple[int, int]:
    """Load one Keras weights/metadata pair; `(epoch, batch)` from the metadata."""
    epoch = batch = 0
    if metadata is not None:
        record = json.loads(files.read_text(files.join(backup_dir, metadata)))
        epoch, batch = int(record["epoch"]), int(record.get("batch", 0))
    if weights is not None:
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # Its variables are saved too.
        with files.local_copy(files.join(backup_dir, weights)) as local:
            if local.endswith(".weights.h5"):
                model.load_weights(local)
            else:
                # Keras picks the format by the file name: give the .bkp copy the name
                # of the file it copies.
                with tempfile.TemporaryDirectory(prefix="keras_accel-") as directory:
                    named = os.path.join(directory, WEIGHTS)
                    os.symlink(os.path.abspath(local), named)
                    model.load_weights(named)
    return epoch, batch
