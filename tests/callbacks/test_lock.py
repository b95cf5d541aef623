"""The backup directory's lock on a local disk, fsspec's memory:// and a real S3 server
(moto's, on 127.0.0.1): created only if absent, refused while its holder lives, taken over
when stale, and a holder whose lock was taken over stops at its next heartbeat.

The lock is storage code, the same on every backend: these run in every backend's lane."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from keras_accel.callbacks._lock import LOCK_NAME, DirectoryLock
from keras_accel.state import files

pytestmark = pytest.mark.torch
# The fixtures of tests/object_stores.py: a fresh bucket on a local server.
_BUCKETS = {"s3": "s3_bucket", "gs": "gcs_bucket"}
# Where a second create-if-absent is refused by the local server. The GCS emulator
# (gcp-storage-emulator) ignores every precondition, ifGenerationMatch=0 included, so gs://
# runs everything else here; GCS itself refuses such an upload with 412.
_EXCLUSIVE = ("local", "memory", "s3")


class _Owner:
    """Stands for the callback that holds the lock (held weakly by the lock)."""

    def in_fit(self) -> bool:
        return True


@pytest.fixture(params=["local", "memory", "s3", "gs"])
def directory(request, tmp_path):
    if request.param == "local":
        path = str(tmp_path / "backup")
        os.makedirs(path)
        yield path
    elif request.param == "memory":
        path = f"memory://lock-{uuid.uuid4().hex[:8]}/backup"
        yield path
        if files.exists(path):
            files.rmtree(path)
    else:
        yield f"{request.getfixturevalue(_BUCKETS[request.param])}/backup"


def _lock(directory, timeout=60.0):
    owner = _Owner()
    lock = DirectoryLock(directory, timeout, owner, owner.in_fit)
    lock.test_owner = owner  # Keeps the weakly held owner alive as long as the lock.
    return lock


def _holder(directory):
    return json.loads(files.read_text(files.join(directory, LOCK_NAME)))


def _put(directory, record):
    files.write_atomic(files.join(directory, LOCK_NAME), json.dumps(record))


def test_free_lock_is_taken_and_released(directory, request):
    lock = _lock(directory)
    lock.acquire(None)
    assert _holder(directory)["token"] == lock.token
    if request.node.callspec.params["directory"] in _EXCLUSIVE:
        # Created only if absent: a second creator finds it there and leaves it as it is.
        assert not _lock(directory)._create()
        assert _holder(directory)["token"] == lock.token
    lock.release()
    assert not files.exists(files.join(directory, LOCK_NAME))


def test_held_refused_stale_taken_over_and_the_old_holder_stops(directory):
    # A live process of this host holds it: refused, naming it, and left untouched.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = {"host": socket.gethostname(), "pid": other.pid, "token": "x", "heartbeat": 0}
        _put(directory, live)
        with pytest.raises(RuntimeError, match=rf"Another training run.*process {other.pid}"):
            _lock(directory).acquire(None)
        assert _holder(directory) == live
    finally:
        other.kill()
        other.wait()
    # Another host's lock within its timeout is held; past it, stale and taken over.
    elsewhere = {"host": "elsewhere", "pid": 1, "token": "y", "heartbeat": time.time()}
    _put(directory, elsewhere)
    with pytest.raises(RuntimeError, match="host 'elsewhere'"):
        _lock(directory, timeout=60.0).acquire(None)
    _put(directory, dict(elsewhere, heartbeat=time.time() - 120))
    ours = _lock(directory, timeout=60.0)
    with pytest.warns(UserWarning, match="taking over the stale lock of process 1"):
        ours.acquire(None)
    assert _holder(directory)["token"] == ours.token
    # Our heartbeat went quiet and another host took over: the next heartbeat stops this
    # run, leaves their record, and release() does not delete it.
    _put(directory, dict(elsewhere, heartbeat=time.time()))
    with pytest.raises(RuntimeError, match="taken over by process 1 on host 'elsewhere'"):
        ours.heartbeat(force=True)
    ours.release()
    assert _holder(directory)["token"] == "y"


@pytest.mark.parametrize("store", ["local", "s3"])
def test_of_racing_creators_exactly_one_wins(store, tmp_path, request):
    """Eight creators at the same moment: the storage's create-if-absent (a hard link; S3's
    If-None-Match) lets exactly one in. memory:// is left out (its create is a check, then
    a write, within one process), and gs:// (see _EXCLUSIVE)."""
    if store == "local":
        directory = str(tmp_path)
    else:
        directory = f"{request.getfixturevalue(_BUCKETS[store])}/backup"
        files.exists(directory)  # One client built before the threads start.
    locks = [_lock(directory) for _ in range(8)]
    start = threading.Barrier(len(locks))
    won = {}

    def create(lock):
        start.wait()
        won[lock.token] = lock._create()

    threads = [threading.Thread(target=create, args=(lock,)) for lock in locks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    winners = [token for token, created in won.items() if created]
    assert len(won) == len(locks) and len(winners) == 1
    assert _holder(directory)["token"] == winners[0]  # Whole, and the winner's.
    if store == "local":
        assert os.listdir(directory) == [LOCK_NAME]  # No temporary sibling left.
