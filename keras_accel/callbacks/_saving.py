"""Keras model files (.keras, .weights.h5, .h5) written to any path, atomically.

Keras's savers write local files only, and a kill half-way leaves a truncated file under the
final name. Here Keras writes a hidden temporary sibling (local) or a local temporary file
(URLs), which is then renamed or uploaded over the target in one step.
"""

from __future__ import annotations

import os
import tempfile

from keras_accel.state import files, outputs
from keras_accel.state.whole import whole_values


def save(model, path: str, weights_only: bool) -> None:
    """`model.save_weights(path)` or `model.save(path)`, to any path, never half-written."""
    path = files.local_path(path)
    if files.isdir(path):
        raise IsADirectoryError(
            f"Cannot save the model to {path!r}: it is an existing directory. Give a file "
            "path ending in .keras (or .weights.h5 with save_weights_only=True)."
        )
    outputs.prepare_parent(path)  # Local directories only: a URL's would make a bucket.
    if files.is_remote(path):
        with tempfile.TemporaryDirectory(prefix="keras_accel-") as directory:
            local = os.path.join(directory, files.basename(path))
            _write(model, local, weights_only)
            files.upload(local, path)
        return
    # Keras writes straight into the sibling: no second copy of a large model file.
    files.replace_local(path, lambda temp: _write(model, temp, weights_only))


def _write(model, local_path: str, weights_only: bool) -> None:
    # Variables split over several processes' devices read whole (a collective: every
    # process saves, the others into scratch); Keras's savers cannot read them otherwise.
    with whole_values(model):
        if weights_only:
            model.save_weights(local_path, overwrite=True)
        else:
            model.save(local_path, overwrite=True)
