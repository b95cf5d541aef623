"""Which fit holds each backup directory in this process, and whether it is still running.

A fit that an exception or Ctrl-C ended never reaches `on_train_end` (Keras skips it), so its
callback still holds the directory (lock, SIGTERM handler, background saves). The next fit on
that directory in this process asks here, and lets go of it first: a notebook's next cell
then resumes, with a model built again. Each callback registers its own `in_fit` and
`abandon` methods, held weakly, as the lock holds its owner's `in_fit`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

from keras_accel.utils import library_internals

# backup_dir -> (in_fit, abandon) of the callback last trained on it, weakly.
_RUNNING: dict[str, tuple[weakref.WeakMethod, weakref.WeakMethod]] = {}


def hold(directory: str, in_fit: Callable[[], bool], abandon: Callable[[], None]) -> None:
    """The callback whose bound methods these are trains on `directory` now."""
    _RUNNING[directory] = (weakref.WeakMethod(in_fit), weakref.WeakMethod(abandon))


def let_go_of_ended(directory: str, owner) -> None:
    """Make the callback that last trained on `directory` let go of it (`abandon`) where
    its fit is no longer running, unless it is `owner` itself."""
    entry = _RUNNING.get(directory)
    if entry is None:
        return
    in_fit, abandon = entry[0](), entry[1]()
    if in_fit is None or abandon is None or in_fit.__self__ is owner:
        return
    if not in_fit():
        abandon()


def on_a_stack(ref: weakref.ref) -> bool:
    """Whether a frame running now, in any thread, holds the object of `ref` among its
    locals (this function's own frame aside: it holds it to compare)."""
    here = inspect.currentframe()
    target = ref()
    if target is None:
        return False
    for top in library_internals.current_frames().values():
        frame = top
        while frame is not None:
            if frame is not here and any(value is target for value in frame.f_locals.values()):
                return True
            frame = frame.f_back
    return False
