"""Keras model files (.keras, .weights.h5, .h5) written to any path, atomically.

Keras's savers write local files (or gfile URLs), and a kill half-way leaves a truncated
file under the final name. Here Keras writes a hidden temporary sibling (local) or a local
temporary file (URLs), which is then renamed or uploaded over the target in one step.
"""

from __future__ import annotations

import os
import tempfile

from keras_accel import io


def save(model, path: str, weights_only: bool) -> None:
    """`model.save_weights(path)` or `model.save(path)`, to any path, never half-written."""
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if io.isdir(path):
        raise IsADirectoryError(
            f"Cannot save the model to {path!r}: it is an existing directory. Give a file "
            "path ending in .keras (or .weights.h5 with save_weights_only=True)."
        )
    parent = io.dirname(path)
    if parent and not io.exists(parent):
        io.makedirs(parent)
    if io.is_remote(path):
        with tempfile.TemporaryDirectory(prefix="keras_accel-") as directory:
            local = os.path.join(directory, io.basename(path))
            _write(model, local, weights_only)
            io.upload(local, path)
        return
    fs = io.filesystem(path)
    temp = fs.temp_sibling(path)
    try:
        _write(model, temp, weights_only)
        fs.fsync_file(temp)
        fs.rename(temp, path)
        fs.fsync_dir(parent)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise


def _write(model, local_path: str, weights_only: bool) -> None:
    if weights_only:
        model.save_weights(local_path, overwrite=True)
    else:
        model.save(local_path, overwrite=True)
