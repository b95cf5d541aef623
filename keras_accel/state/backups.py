"""The backups of one directory on its engine: open the engine, save a step, wait for it,
list, delete, and name what went wrong when a write fails (`keras_accel.state.faults`).

`keras_accel.callbacks.BackupAndRestore` decides when and what to back up; this writes it.
The engine each backup_dir of this process opened, and the step each is writing in the
background, are kept per process: a fit that an exception ended (Keras then skips
`on_train_end`) may still be writing, and the next one on the same directory, or the
interpreter's exit, lets that save finish first.
"""

from __future__ import annotations

import contextlib
import os
import sys

from keras_accel.state import engines, faults, files, keras_backups
from keras_accel.utils import library_internals, process

# The engine each backup_dir of this process was opened with.
_OPEN: dict[str, object] = {}
# The step each backup_dir of this process is writing in the background, until it is on disk.
_WRITING: dict[str, int] = {}
_AT_EXIT = False


def _finish_saves_at_exit() -> None:
    """At interpreter exit, every background save of this process reaches the disk.

    A `fit` that an exception ends (a crash, a KeyboardInterrupt) skips `on_train_end`, the
    callback's wait, and the interpreter then exits with the last backup still being written.
    tf.train's asynchronous save joins its thread at exit; Orbax's is stopped half-way (its
    writer needs thread pools that Python shuts down first), and the next run would silently
    start from the backup before, or from scratch. A killed process still loses the save in
    flight; the next run then says so (`keras_accel.state.recovery`).
    """
    for directory, engine in list(_OPEN.items()):
        try:
            engine.wait()
        except Exception as error:  # Exiting anyway: say what was lost.
            print(write_error(directory, _WRITING.get(directory), error, engine), file=sys.stderr)
        _WRITING.pop(directory, None)


def _wait_at_exit() -> None:
    global _AT_EXIT
    if _AT_EXIT or process.num_processes() > 1:
        # Across processes a save ends with a barrier of all of them: a process leaving on
        # an error must not wait for peers (utils/cluster.py ends it at once).
        return
    _AT_EXIT = True
    # Before threading's own exit hooks, which shut down concurrent.futures' pools (Orbax
    # writes through them); registered later, it runs earlier. atexit runs too late.
    with contextlib.suppress(RuntimeError):  # Raised when already shutting down.
        library_internals.register_before_thread_pools_shutdown(_finish_saves_at_exit)


def check_directory(backup_dir) -> None:
    """A backup_dir is a non-empty path or URL (Keras's wording first: code may match it,
    then what would work)."""
    if not backup_dir:
        raise ValueError(
            f"Empty `backup_dir` argument passed. Received: backup_dir={backup_dir!r}. "
            "Pass the directory (a path or a URL) to keep the backups in."
        )
    if not isinstance(backup_dir, (str, os.PathLike)):
        raise ValueError(
            "`backup_dir` must be a path or URL string. "
            f"Received: backup_dir={backup_dir!r} of type {type(backup_dir).__name__}"
        )


def writable_directory(backup_dir, module) -> str:
    """`backup_dir` as the engine of `module` is given it (a local path made absolute), or
    an error where that engine cannot write it."""
    backup_dir = os.fspath(backup_dir)
    if not files.is_remote(backup_dir):
        backup_dir = os.path.abspath(backup_dir.removeprefix("file://"))
    if not module.supports(backup_dir):
        raise ValueError(
            f"BackupAndRestore stores training state through "
            f"{module.NAME}, which cannot write {backup_dir!r}: it writes "
            f"{module.WRITES}. Received: backup_dir={backup_dir!r}. Use a local "
            "directory or a URL whose fsspec package is installed (s3:// needs "
            "`pip install s3fs`)."
        )
    return backup_dir


class Backups:
    """The backups in `directory`, on the engine of `module` (`keras_accel.state.engines`),
    the newest `max_to_keep` kept, saved in the background when `asynchronous`, each step's
    record signed with `signing_key` where one is given. The engine opens on first use and
    stays open until `close()`."""

    def __init__(
        self,
        directory: str,
        module,
        max_to_keep: int,
        asynchronous: bool,
        signing_key: bytes | None = None,
    ):
        self.directory = directory
        self._signing_key = signing_key  # Handed to the engine only; never shown.
        self.module = module
        self.max_to_keep = max_to_keep
        self.asynchronous = asynchronous
        self._engine = None

    @property
    def is_open(self) -> bool:
        return self._engine is not None

    def open(self):
        """The engine, opened on first use."""
        if self._engine is None:
            # A fit of this process that an exception ended (Keras then skips on_train_end)
            # may still be writing here in the background: let it finish first.
            previous = _OPEN.pop(self.directory, None)
            if previous is not None:
                with contextlib.suppress(Exception):
                    previous.close()
            self._engine = engines.open_engine(
                self.module,
                self.directory,
                self.max_to_keep,
                asynchronous=self.asynchronous,
                signing_key=self._signing_key,
            )
            _OPEN[self.directory] = self._engine
            _wait_at_exit()
        return self._engine

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            if _OPEN.get(self.directory) is engine:
                del _OPEN[self.directory]
            with contextlib.suppress(Exception):
                engine.close()

    def wait(self) -> None:
        """Block until every backup started here is on disk (nothing to do if not open).

        Raises:
            OSError: a background save failed, naming the directory, the step, the cause
                and the newest intact backup (`keras_accel.state.faults`).
        """
        if self._engine is None:
            return
        try:
            self._engine.wait()
        except Exception as error:
            raise self._error(_WRITING.get(self.directory), error) from error
        finally:
            _WRITING.pop(self.directory, None)

    def save(self, step: int, state: dict, meta: dict) -> str:
        """Save `state` (`{key: keras.Variable}`) and the record `meta` as backup `step`,
        after the save before it is on disk; returns the backup's path."""
        engine = self.open()
        # The save before this one, if still in flight, is on disk first: a failure of it
        # is named as its own step's, not this one's.
        self.wait()
        try:
            if engine.has(step):
                # Only a backup a run restored past (an unusable one) sits at a step not
                # yet done; this replaces it.
                engine.wait()
                engine.delete(step)
            _WRITING[self.directory] = step
            engine.save(step, state, meta)
            if not self.asynchronous:
                engine.wait()
                del _WRITING[self.directory]
        except Exception as error:
            _WRITING.pop(self.directory, None)
            raise self._error(step, error) from error
        return engine.path(step)

    def _error(self, step: int | None, error: Exception) -> OSError:
        return write_error(self.directory, step, error, self._engine)

    def paths(self) -> list[str]:
        """Paths of the complete backups, oldest first."""
        if not files.isdir(self.directory):
            return []
        engine = self.open()
        return [engine.path(step) for step in engine.steps()]

    def newest_files(self, newest: int, which: int) -> str | None:
        """File `which` of `engine.files(step)` (0: the arrays, 1: the record) of the
        `newest`-th newest backup, None where there are fewer."""
        if not files.isdir(self.directory):
            return None
        engine = self.open()
        steps = engine.steps()
        return engine.files(steps[-newest])[which] if len(steps) >= newest else None

    def delete_all(self) -> None:
        """The engine deletes every backup; every process calls this (Orbax meets the other
        processes there; tf.train deletes from the chief only)."""
        self.open().delete_all()

    def remove_keras_files(self) -> None:
        """A Keras backup a run resumed from: the backup just started holds a later state,
        as Keras's own next save would overwrite its file."""
        for name in self.listdir():
            if name in keras_backups.FILES:
                _quietly(files.remove, files.join(self.directory, name))

    def remove_directory(self) -> None:
        if files.isdir(self.directory):
            _quietly(files.rmtree, self.directory)

    def prepare(self) -> None:
        """Create the directory, with an error that says what is in the way."""
        path = self.directory
        try:
            if files.exists(path) and not files.isdir(path):
                raise NotADirectoryError(
                    f"BackupAndRestore: backup_dir {path!r} is a file, not a directory. "
                    "Point backup_dir at a directory (it is created if missing)."
                )
            files.makedirs(path)
        except NotADirectoryError as e:
            if "is a file, not a directory" in str(e):
                raise
            raise NotADirectoryError(
                f"BackupAndRestore: cannot create backup_dir {path!r}: a part of it is a file "
                f"({e}). Point backup_dir at a directory."
            ) from e
        except FileExistsError as e:
            raise NotADirectoryError(
                f"BackupAndRestore: cannot create backup_dir {path!r}: a part of it is a file "
                f"({e}). Point backup_dir at a directory."
            ) from e
        except OSError as e:
            raise PermissionError(
                f"BackupAndRestore: cannot create or write backup_dir {path!r}: {e}. Point "
                "backup_dir at a writable directory (local path or URL)."
            ) from e

    def listdir(self) -> list[str]:
        try:
            return files.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []


def write_error(directory: str, step: int | None, error: Exception, engine) -> OSError:
    """`faults.write_error` with the engine's committed steps (None where it cannot list
    them now)."""
    intact = None
    if engine is not None:
        with contextlib.suppress(Exception):
            intact = engine.steps()
    return faults.write_error(
        directory, step, error, intact, engine.path if engine is not None else str
    )


def _quietly(function, *args) -> None:
    with contextlib.suppress(OSError, ValueError):
        function(*args)
