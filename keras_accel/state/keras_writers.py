"""Keras's own callbacks that write files, under several processes: one set of files, the
chief's, as one process would write.

Every process of a run calls every callback (a callback may read state that takes every
process, and Keras's loop is the same everywhere), so Keras's `TensorBoard` in a script
run by `keras-accel launch -n 2` wrote its event files from both processes: four files
where one process writes two, every curve drawn twice. keras_accel's callbacks ask
`is_chief()` themselves; Keras's cannot. For the length of an Accelerator call, the
callbacks below write, on every process but the chief, into a temporary directory of their
own, removed when the call ends (TensorFlow's multi-worker recipe for Keras's writers: the
other workers write scratch copies). They run exactly as on the chief, collectives and all;
only where their files land differs. Their attribute is put back when the call ends.

- `keras.callbacks.TensorBoard`: `log_dir`;
- `keras.callbacks.CSVLogger`: `filename` (with `append=True` both processes appended rows
  to the one file);
- `keras.callbacks.ModelCheckpoint`: `filepath` (two processes writing one `.keras` file
  at once can leave a file of neither).

Subclasses of these count (a user's `TensorBoard` subclass writes where it does), except
keras_accel's own (`keras_accel.callbacks.ModelCheckpoint` writes from the chief itself).
A user's own callback that writes files asks `acc.is_chief` (docs/callbacks.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

from keras_accel.utils import process

# Keras's callbacks that write files, by class name under `keras.callbacks`: the attribute
# that names where, and whether it is a directory (else a file, named by its last part).
WRITERS = {"TensorBoard": ("log_dir", True), "CSVLogger": ("filename", False)}
WRITERS["ModelCheckpoint"] = ("filepath", False)


def chief_writes(callbacks, on_exit: Callable[[Callable[[], None]], None]) -> None:
    """On a process other than the chief of several, point each of Keras's file-writing
    callbacks in the list `callbacks` at a temporary directory for the call; `on_exit(undo)`
    registers what puts it back (the Accelerator call's exit). Nothing in one process, on
    the chief, or for a `keras.callbacks.CallbackList` (made already: Keras's TensorBoard
    has read its `log_dir` when the list set its model)."""
    if not isinstance(callbacks, (list, tuple)) or process.num_processes() == 1:
        return
    if process.is_chief():
        return
    for callback in callbacks:
        found = _writer(callback)
        if found is None:
            continue
        attribute, directory = found
        where = getattr(callback, attribute, None)
        if not where:
            continue
        scratch = tempfile.mkdtemp(prefix="keras_accel-not-chief-")
        setattr(
            callback,
            attribute,
            scratch if directory else os.path.join(scratch, os.path.basename(str(where))),
        )
        on_exit(_undo(callback, attribute, where, scratch))


def _writer(callback) -> tuple[str, bool] | None:
    """(attribute, is a directory) where `callback` is one of Keras's file writers."""
    import keras

    if type(callback).__module__.startswith("keras_accel."):
        return None
    for name, found in WRITERS.items():
        if isinstance(callback, getattr(keras.callbacks, name)):
            return found
    return None


def _undo(callback, attribute: str, where, scratch: str) -> Callable[[], None]:
    def undo() -> None:
        setattr(callback, attribute, where)
        shutil.rmtree(scratch, ignore_errors=True)

    return undo
