"""A lock file that keeps two training runs out of one backup directory.

Two runs writing the same checkpoints would overwrite each other's state, and a resume
would mix them. The lock records who holds it (host, process id, a random token) and a
heartbeat time that the holder refreshes while it trains. A lock is stale, and is taken
over with a warning, when its process is gone (same host) or its heartbeat is older than
the timeout (another host, e.g. a preempted TPU VM whose job restarted elsewhere).

There is no `flock` on an object store (nor across the hosts of a shared disk), so the lock
is an object created only if absent, which every storage here can do in one step:

- a local disk: the record is written to a hidden sibling and hard-linked to `.lock`
  (`link` fails if the name exists), so the file appears whole or not at all;
- s3://: a PUT with `If-None-Match: *` (AWS S3 since 2024, MinIO, moto);
- gs://: an upload with `ifGenerationMatch=0`;
- any other fsspec protocol: fsspec's "create" mode, which on some is a check then a
  write; there, and on an S3-compatible store that ignores `If-None-Match`, the record is
  read back after writing and of two runs at the same moment the one whose record stuck
  wins, which still leaves a short window.

So of two runs that start on a free directory at the same moment, exactly one gets the
lock. Taking over a *stale* lock is a delete then a create (no store here can replace an
object only if it is still a given version through fsspec): a third run that judged the
same lock stale in the same moment can remove the new holder's lock. Each heartbeat
therefore first reads the lock, and a holder that finds another process's record there
stops with an error naming it, so at most one run goes on past its next heartbeat
(every `lock_timeout / 4` seconds, or 60 s without a timeout).
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


def check_timeout(timeout: float | None) -> None:
    """A lock timeout is a positive number of seconds, or None (never stale by age)."""
    if timeout is not None and not timeout > 0:
        raise ValueError(
            "`lock_timeout` must be a positive number of seconds, or None. "
            f"Received: lock_timeout={timeout!r}"
        )


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
            text = files.read_text(self.path)
        except FileNotFoundError:
            return None
        try:
            holder = json.loads(text)
        except ValueError:
            return {}  # Unreadable: treated as held by nobody we can name.
        return holder if isinstance(holder, dict) else {}

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
                and other.running()
                and keras_internals.callback_model(other.owner()) is not owner_model
            )
        if same_host and isinstance(pid, int):
            return not _pid_alive(pid)
        if self.timeout is None:
            return False
        return time.time() - float(holder.get("heartbeat", 0.0)) > self.timeout

    def acquire(self, owner_model) -> None:
        # Two rounds: a lock created by another run between our read and our create is
        # judged like one found at the start (held: an error naming it; stale: taken over).
        for _ in range(2):
            holder = self._read()
            if holder is None:
                if self._create():
                    break
                continue
            if not self._stale(holder, owner_model):
                raise RuntimeError(
                    f"Another training run is using the backup directory {self.directory!r}: "
                    f"{self._describe(holder)}. Two runs saving to one directory would "
                    "overwrite each other's checkpoints. Give this run its own backup_dir, or, "
                    f"if that run is gone, delete {self.path!r}."
                )
            if holder.get("token") == self.token or self._of_this_process(holder):
                # Ours, or a leftover of this process (a fit that raised): no other run
                # can be racing for it, so it is rewritten in place.
                self._write()
                break
            if self._take_over(holder):
                if holder:  # Another run's lock, named (an unreadable one names nobody).
                    warnings.warn(
                        f"BackupAndRestore: taking over the stale lock of "
                        f"{self._describe(holder)} in {self.directory!r}.",
                        stacklevel=3,
                    )
                break
        else:
            raise self._raced()
        # Read back: a store whose "create if absent" is a check then a write (or that
        # ignores the condition) may have let two runs in; the one whose record stuck wins.
        if (self._read() or {}).get("token") != self.token:
            raise self._raced()
        self._held = True
        _HELD[self.directory] = weakref.ref(self)

    def _raced(self) -> RuntimeError:
        return RuntimeError(
            f"Another training run took the lock of {self.directory!r} at the same moment. "
            "Give each run its own backup_dir."
        )

    def _of_this_process(self, holder: dict) -> bool:
        return holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()

    def _take_over(self, stale: dict) -> bool:
        """Replace the stale lock `stale` by ours; False if another run got there first."""
        # Still the record judged stale? Another run taking it over too may have replaced it.
        if self._read() != stale:
            return False
        with contextlib.suppress(FileNotFoundError):
            files.remove(self.path)
        return self._create()

    def _create(self) -> bool:
        """Write our record as the lock only if there is none: True if it was written."""
        data = json.dumps(self._record()).encode("utf-8")
        if not files.create_new(self.path, data):
            return False
        self._last_beat = time.monotonic()
        return True

    def owner(self):
        """The callback this lock is held for (None once it is gone)."""
        return self._owner()

    def running(self) -> bool:
        """Whether the owner is alive and its fit is running now."""
        in_fit = self._in_fit()
        return self._owner() is not None and in_fit is not None and in_fit()

    def _write(self) -> None:
        files.write_atomic(self.path, json.dumps(self._record()))
        self._last_beat = time.monotonic()

    def heartbeat(self, force: bool = False) -> None:
        """Refresh the heartbeat, at most every quarter of the timeout unless forced.

        Raises:
            RuntimeError: another process has taken the lock over (it judged this run's
                heartbeat too old): two runs must not go on in one directory.
        """
        if not self._held:
            return
        interval = 60.0 if self.timeout is None else self.timeout / 4
        if not (force or time.monotonic() - self._last_beat >= interval):
            return
        holder = self._read()
        if holder and holder.get("token") != self.token and not self._of_this_process(holder):
            self._held = False  # Theirs now: release() must not delete it.
            raise RuntimeError(
                f"The lock of the backup directory {self.directory!r} was taken over by "
                f"{self._describe(holder)}, which judged this run's lock stale (its heartbeat "
                f"older than lock_timeout={self.timeout}). This run stops so that the two do not "
                "overwrite each other's checkpoints; raise lock_timeout if this run was "
                "only slow."
            )
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
