"""Python's standard library: another thread's stack (`sys`), the hook that runs before
`concurrent.futures`' pools shut down (`threading`), and ending a process at once (`os`)."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

from keras_accel.utils.library_internals.lookup import Internal, find, find_optional

_CURRENT_FRAMES = Internal(
    "Python",
    "sys",
    "_current_frames",
    "the stacks of other threads: is an interrupted fit still running anywhere "
    "(BackupAndRestore's lock)? Documented in the sys module; no public name",
)
_REGISTER_ATEXIT = Internal(
    "Python",
    "threading",
    "_register_atexit",
    "a hook that runs before threading shuts down concurrent.futures' pools, which "
    "Orbax writes through (Python >= 3.9)",
    fallback="atexit.register, too late for a save still being written",
)
_EXIT = Internal(
    "Python",
    "os",
    "_exit",
    "ending a process at once after an uncaught error, without waiting for peers that "
    "will never arrive (documented in the os module)",
)
INTERNALS = [_CURRENT_FRAMES, _REGISTER_ATEXIT, _EXIT]


def current_frames() -> dict[int, Any]:
    """`sys._current_frames()`: each thread's topmost frame, by thread id."""
    return find(_CURRENT_FRAMES)()


def register_before_thread_pools_shutdown(function: Callable[[], None]) -> None:
    """Run `function` at exit before threading shuts down concurrent.futures' pools (later
    registrations run earlier); `atexit.register` where Python lacks the hook. Raises
    RuntimeError when the interpreter is already shutting down."""
    register = find_optional(_REGISTER_ATEXIT)
    (register or atexit.register)(function)


def exit_now(code: int) -> None:
    """`os._exit(code)`: end the process without cleanup handlers or waiting for threads."""
    find(_EXIT)(code)
