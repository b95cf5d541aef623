"""A lock file that keeps two training runs out of one backup directory.

Two runs writing the same checkpoints would overwrite each other's state, and a resume
would mix them. The lock records who holds it (host, process id, a random token) and a
heartbeat time that the holder refreshes while it trains. A lock is stale, and is taken
over with a warning, when its process is gone (same host) or its heartbeat is older than
the timeout (another host, e.g. a preempted TPU VM whose job restarted elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
import warnings
import weakref

from keras_accel.state import files
from keras_accel.utils import keras_internals

LOCK_NAME = ".lock"

# Locks held by this process: directory -> the lock, to tell a second callback in this
# process (an error while the first one trains) from a leftover of an aborted fit.
_HELD: dict[str, weakref.ref] = {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # Alive, owned by someone else.
        return True
    except OSError:
        return False
    return True


class DirectoryLock:
    """The lock of `directory`, held for the callback `owner`; `in_fit()` (a method of
    `owner`) says whether the owner's fit is running now. Both are held weakly."""

    def __init__(self, directory: str, timeout: float | None, owner, in_fit):
        self.directory = directory
        self.path = files.join(directory, LOCK_NAME)
        self.timeout = timeout
        self.token = uuid.uuid4().hex
        self._owner = weakref.ref(owner)
        self._in_fit = weakref.WeakMethod(in_fit)
        self._held = False
        self._last_beat = 0.0

    def _record(self) -> dict:
        now = time.time()
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self.token,
            "heartbeat": now,
        }

    def _read(self) -> dict | None:
        try:
            return json.loads(files.read_text(self.path))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # Unreadable: treated as held by nobody we can name.

    def _describe(self, holder: dict) -> str:
        age = time.time() - float(holder.get("heartbeat", 0.0))
        return (
            f"process {holder.get('pid')} on host {holder.get('host')!r} (last heartbeat "
            f"{age:.0f} s ago)"
        )

    def _stale(self, holder: dict, owner_model) -> bool:
        if not holder:
            return True
        if holder.get("token") == self.token:
            return True  # Our own, from an earlier fit of this callback.
        same_host = holder.get("host") == socket.gethostname()
        pid = holder.get("pid")
        if same_host and pid == os.getpid():
            other = _HELD.get(self.directory)
            other = other() if other is not None else None
            # Another callback of this process whose fit of a different model is running
            # now is a real conflict; anything else is a leftover of a fit that an exception
            # or Ctrl-C ended (Keras skips on_train_end then): a notebook's next cell.
            return not (
                other is not None
                and other is not self
                and other._running()
                and keras_internals.callback_model(other._owner()) is not owner_model
            )
        if same_host and isinstance(pid, int):
            return not _pid_alive(pid)
        if self.timeout is None:
            return False
        return time.time() - float(holder.get("heartbeat", 0.0)) > self.timeout

    def acquire(self, owner_model) -> None:
        holder = self._read()
        if holder is not None and not self._stale(holder, owner_model):
            raise RuntimeError(
                f"Another training run is using the backup directory {self.directory!r}: "
                f"{self._describe(holder)}. Two runs saving to one directory would overwrite "
                "each other's checkpoints. Give this run its own backup_dir, or, if that run "
                f"is gone, delete {self.path!r}."
            )
        ours = (
            holder
            and holder.get("pid") == os.getpid()
            and (holder.get("host") == socket.gethostname())
        )
        if holder and holder.get("token") != self.token and not ours:
            # A leftover of this process (a fit that raised) is not news; another's is.
            warnings.warn(
                f"BackupAndRestore: taking over the stale lock of {self._describe(holder)} "
                f"in {self.directory!r}.",
                stacklevel=3,
            )
        self._write()
        # Read back: of two runs racing for a free lock, the one whose token stuck wins.
        if (self._read() or {}).get("token") != self.token:
            raise RuntimeError(
                f"Another training run took the lock of {self.directory!r} at the same "
                "moment. Give each run its own backup_dir."
            )
        self._held = True
        _HELD[self.directory] = weakref.ref(self)

    def _running(self) -> bool:
        """Whether the owner is alive and its fit is running now."""
        in_fit = self._in_fit()
        return self._owner() is not None and in_fit is not None and in_fit()

    def _write(self) -> None:
        files.write_atomic(self.path, json.dumps(self._record()))
        self._last_beat = time.monotonic()

    def heartbeat(self, force: bool = False) -> None:
        """Refresh the heartbeat, at most every quarter of the timeout unless forced."""
        if not self._held:
            return
        interval = 60.0 if self.timeout is None else self.timeout / 4
        if force or time.monotonic() - self._last_beat >= interval:
            self._write()

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        held = _HELD.get(self.directory)
        if held is not None and held() is self:
            del _HELD[self.directory]
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                files.remove(self.path)
