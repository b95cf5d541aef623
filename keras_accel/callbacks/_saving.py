"""Keras model files (.keras, .weights.h5, .h5) written to any path, atomically.

Keras's savers write local files only, and a kill half-way leaves a truncated file under the
final name. Here Keras writes a hidden temporary sibling (local) or a local temporary file
(URLs), which is then renamed or uploaded over the target in one step.
"""

from __future__ import annotations

import os
import tempfile

from keras_accel.state import files


def save(model, path: str, weights_only: bool) -> None:
    """`model.save_weights(path)` or `model.save(path)`, to any path, never half-written."""
    path = files.local_path(path)
    if files.isdir(path):
        raise IsADirectoryError(
            f"Cannot save the model to {path!r}: it is an existing directory. Give a file "
            "path ending in .keras (or .weights.h5 with save_weights_only=True)."
        )
    parent = files.dirname(path)
    if parent and not files.exists(parent):
        files.makedirs(parent)
    if files.is_remote(path):
        with tempfile.TemporaryDirectory(prefix="keras_accel-") as directory:
            local = os.path.join(directory, files.basename(path))
            _write(model, local, weights_only)
            files.upload(local, path)
        return
    # Keras writes straight into the sibling: no second copy of a large model file.
    temp = files.temp_sibling(path)
    try:
        _write(model, temp, weights_only)
        with open(temp, "rb") as f:
            os.fsync(f.fileno())  # The data is on disk before the name points at it...
        os.replace(temp, path)
        _fsync_dir(parent)  # ...and the rename itself survives a power cut.
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise


def _write(model, local_path: str, weights_only: bool) -> None:
    if weights_only:
        model.save_weights(local_path, overwrite=True)
    else:
        model.save(local_path, overwrite=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:  # Some platforms (Windows) cannot open directories: nothing to sync.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
