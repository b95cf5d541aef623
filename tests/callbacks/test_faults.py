"""BackupAndRestore's fault matrix: a damaged file (every engine, every store), a full disk,
a kill inside a commit and a stale lock. Each ends resumed exactly (the weights of a run
that never met the fault, bit for bit) or stopped with the error that says what happened,
never trained on silently.

One small model, three epochs of 4 steps, a backup each epoch (steps 4, 8, 12), plain
`model.fit` without shuffling (a mid-run resume is exact by construction there).
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import types
import warnings

import keras
import numpy as np
import pytest

from keras_accel.callbacks import BackupAndRestore
from keras_accel.state import checksums, engines, files
from tests.gcs_emulator import gcs_like_google  # noqa: F401 - a fixture, asked for by name.
from tests.helpers import compiled_mlp, data, weights_of

pytestmark = pytest.mark.torch  # Every backend's engine: Orbax, tf.train, DCP.

EPOCHS = 3
BATCH = 8
X, Y = data(32)  # 4 steps an epoch.
HERE = os.path.dirname(os.path.abspath(__file__))


def model():
    """The matrix's model, named as in a new process."""
    keras.backend.clear_session(free_memory=False)
    return compiled_mlp(optimizer=keras.optimizers.Adam(0.01))


def fit(trained, *callbacks, epochs=EPOCHS):
    trained.fit(
        X, Y, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks)
    )
    return weights_of(trained)


@pytest.fixture(scope="module")
def uninterrupted():
    """The weights of the run that meets no fault."""
    weights = fit(model())
    keras.backend.clear_session()
    return weights


def _assert_same(weights, expected):
    assert len(weights) == len(expected)
    for a, b in zip(weights, expected):
        np.testing.assert_array_equal(a, b)


def _sizes(step_path: str) -> dict[str, int]:
    """{path: size} of the files of a backup step: its directory's, or tf.train's
    `ckpt-N.*` files beside it."""
    import fsspec

    if not files.is_remote(step_path):
        if os.path.isdir(step_path):
            return {
                os.path.join(root, name): os.path.getsize(os.path.join(root, name))
                for root, _, names in os.walk(step_path)
                for name in names
            }
        parent = os.path.dirname(step_path)
        prefix = os.path.basename(step_path) + "."
        return {
            os.path.join(parent, name): os.path.getsize(os.path.join(parent, name))
            for name in os.listdir(parent)
            if name.startswith(prefix)
        }
    fs, inner = fsspec.core.url_to_fs(step_path)
    fs.invalidate_cache()
    protocol = files.scheme(step_path)
    return {
        f"{protocol}://{path}": info["size"] for path, info in fs.find(inner, detail=True).items()
    }


def _flip_64_bytes(path: str) -> tuple[bytes, bytes]:
    """Invert 64 bytes in the middle of the file `path` (local or an object): (before, after)."""
    before = files.read_bytes(path)
    middle = len(before) // 2
    after = before[:middle] + bytes(255 - b for b in before[middle : middle + 64])
    after += before[middle + 64 :]
    if files.is_remote(path):
        files.write_atomic(path, after)
    else:
        with open(path, "r+b") as f:  # In place, as a disk's fault would.
            f.seek(middle)
            f.write(after[middle : middle + 64])
    return before, after


@pytest.mark.parametrize("store", ["local", "s3", "gs"])
def test_a_damaged_newest_backup_is_named_set_aside_and_the_run_resumes_exactly(
    store, request, tmp_path, uninterrupted
):
    """64 bytes flipped in the middle of the newest step's largest file (what resumed without
    a word on Orbax and DCP, ending in NaN or weights off by 2.9e8): the rerun warns with
    the step, the file and what differs, sets the step aside and resumes from the step before,
    ending as the uninterrupted run."""
    backend = keras.backend.backend()
    if store == "gs" and backend == "tensorflow":
        pytest.skip(
            "tf.train writes gs:// through TensorFlow's own GCS client, whose endpoint no "
            "emulator reaches (docs/callbacks.md); it checks its own checksums there too"
        )
    root = {
        "local": lambda: str(tmp_path),
        "s3": lambda: request.getfixturevalue("s3_bucket"),
        # The emulator answers as GCS does first (tests/gcs_emulator.py), then the bucket.
        "gs": lambda: [request.getfixturevalue(f) for f in ("gcs_like_google", "gcs_bucket")][1],
    }[store]()
    backup_dir = files.join(root, "backup")
    first = BackupAndRestore(backup_dir, delete_checkpoint=False)
    fit(model(), first, epochs=2)  # A run that ended after 2 of 3 epochs: steps 4 and 8.
    newest = first.checkpoints()[-1]
    assert re.search(r"\b(ckpt-|dcp-|orbax-|tf-)?8$", newest), newest
    sizes = _sizes(newest)
    target = max(sizes, key=sizes.get)
    before, after = _flip_64_bytes(target)

    with pytest.warns(UserWarning) as caught:
        resumed = fit(model(), BackupAndRestore(backup_dir))
    (warning,) = [str(w.message) for w in caught if "is damaged" in str(w.message)]
    aside = re.search(r"It is kept as '([^']*)'", warning).group(1)
    if backend == "tensorflow" and store == "local":
        # tf.train's own checksum, per tensor, in TensorFlow's words.
        name = os.path.basename(target)
        mismatch = r"Checksum does not match: stored \d+ vs\. calculated on the restored bytes \d+"
    else:
        name = target[len(newest) + 1 :]
        mismatch = re.escape(
            f"CRC32C {checksums.digest_bytes(after)} where its commit recorded "
            f"{checksums.digest_bytes(before)} (same size, {len(before)} bytes)"
        )
    assert re.fullmatch(
        re.escape(f"BackupAndRestore: the backup of step 8 in {backup_dir!r} is damaged: {name}: ")
        + mismatch
        + re.escape(
            f". It is kept as {aside!r}, never resumed from or counted as the latest again. "
            "Resuming from step 4, the newest intact backup."
        ),
        warning,
    ), warning
    _assert_same(resumed, uninterrupted)
    # Kept where it says, out of every listing; the rest deleted as training ended.
    assert files.dirname(aside) == files.join(backup_dir, checksums.DAMAGED)
    assert files.listdir(aside)
    assert files.listdir(backup_dir) == [checksums.DAMAGED]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 8 MiB mounted at tmp_path/disk for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs, which only root can mount; run as root")
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"root, but mounting a tmpfs failed here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_with_the_common_wording_and_the_rerun_resumes_exactly(
    small_disk, uninterrupted
):
    """The disk fills during a background save: the fit stops naming the directory, the step
    that failed, the cause and the newest intact step; nothing of the failed step is left
    that could pass for a backup; with space again the same fit resumes exactly."""
    backup_dir = str(small_disk / "backup")
    fit(model(), BackupAndRestore(backup_dir, delete_checkpoint=False), epochs=1)  # Step 4.
    one_step = shutil.disk_usage(small_disk).used
    # Room for about half a step more: the next save fails part-way.
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(shutil.disk_usage(small_disk).free - one_step // 2, 0))

    with pytest.raises(OSError) as stopped:
        fit(model(), BackupAndRestore(backup_dir, delete_checkpoint=False))
    message = str(stopped.value)
    step = int(re.search(r"the backup of step (\d+) to", message).group(1))
    assert step in (8, 12), message
    engine = engines.open_engine(keras.backend.backend(), backup_dir, 5, asynchronous=False)
    try:
        intact = engine.steps()
        assert engine.interrupted == []  # Nothing half-written that reads as a killed save.
        path = engine.path(intact[-1])
    finally:
        engine.close()
    assert intact == [4, 8][: step // 4 - 1]
    assert stopped.value.errno == 28
    assert re.fullmatch(
        re.escape(
            f"BackupAndRestore: could not write the backup of step {step} to {backup_dir!r}: "
            "no space left on the device ("
        )
        + r".+"
        + re.escape(
            "). Nothing of it is left that a later run could take for a backup. The newest "
            f"intact backup is step {intact[-1]} ({path}): run the same fit again, once "
            "there is space again, to resume from it."
        ),
        message,
        re.S,
    ), message

    filler.unlink()
    resumed = fit(model(), BackupAndRestore(backup_dir))
    _assert_same(resumed, uninterrupted)


def test_a_kill_inside_a_commit_is_named_and_the_rerun_resumes_exactly(tmp_path, uninterrupted):
    """SIGKILL while step 8 commits (tests/callbacks/_fault_script.py): the step was never
    committed, so the rerun names it, removes its files and resumes from step 4 (on
    TensorFlow, whose write runs in its own thread, step 8 may have committed just before the
    kill: then the rerun resumes from it); both end as the uninterrupted run. The killed
    process's lock is taken over, named."""
    backup_dir = str(tmp_path / "backup")
    killed = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_fault_script.py"), backup_dir],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, _ = killed.communicate(timeout=600)
    assert killed.returncode == -9, output[-3000:]
    uncommitted = _uncommitted(backup_dir)
    assert uncommitted or keras.backend.backend() == "tensorflow"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(model(), BackupAndRestore(backup_dir))
    lock, *ours = [str(w.message) for w in caught if "BackupAndRestore" in str(w.message)]
    assert re.fullmatch(
        re.escape(
            f"BackupAndRestore: taking over the stale lock of process {killed.pid} on host "
            f"{socket.gethostname()!r} (last heartbeat "
        )
        + r"\d+"
        + re.escape(f" s ago) in {backup_dir!r}."),
        lock,
    ), lock
    assert ours == (
        [
            f"BackupAndRestore: the backup of step 8 in {backup_dir!r} was still being "
            "written when its process ended (killed, or gone before the save finished), so "
            f"{_engine_name()} never committed it; its partial files are removed. Resuming "
            "from the complete backups (steps [4]), newest first."
        ]
        if uncommitted
        else []
    )
    _assert_same(resumed, uninterrupted)


def _engine_name() -> str:
    return engines.engine_module(keras.backend.backend()).NAME


def _uncommitted(backup_dir: str) -> bool:
    """Whether the killed run left step 8 uncommitted (Orbax's temporary directory, DCP's
    `dcp-8` without `.metadata`, tf.train's `ckpt-8_temp` or data without index)."""
    names = os.listdir(backup_dir)
    dcp = "dcp-8" in names and not os.path.exists(os.path.join(backup_dir, "dcp-8", ".metadata"))
    tf_data = any(name.startswith("ckpt-8.data") for name in names)
    return (
        any(name.startswith("8.orbax-checkpoint-tmp") or name == "ckpt-8_temp" for name in names)
        or dcp
        or (tf_data and "ckpt-8.index" not in names)
    )


def test_a_stale_lock_of_a_killed_run_is_taken_over_and_the_run_resumes_exactly(
    tmp_path, uninterrupted
):
    """A run killed after 2 epochs leaves its lock (its process gone): the rerun takes it
    over with a warning naming that process and resumes exactly."""
    backup_dir = str(tmp_path / "backup")
    fit(model(), BackupAndRestore(backup_dir, delete_checkpoint=False), epochs=2)
    ended = [sys.executable, "-c", "import os; print(os.getpid())"]
    gone = subprocess.run(ended, capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    record = {"host": host, "pid": int(gone), "token": "killed", "heartbeat": time.time() - 30}
    with open(os.path.join(backup_dir, ".lock"), "w") as f:
        json.dump(record, f)

    with pytest.warns(UserWarning) as caught:
        resumed = fit(model(), BackupAndRestore(backup_dir))
    (warning,) = [str(w.message) for w in caught if "stale lock" in str(w.message)]
    assert re.fullmatch(
        re.escape(f"BackupAndRestore: taking over the stale lock of process {gone} on host ")
        + re.escape(f"{host!r} (last heartbeat ")
        + r"\d+"
        + re.escape(f" s ago) in {backup_dir!r}."),
        warning,
    ), warning
    _assert_same(resumed, uninterrupted)
    assert not os.path.exists(backup_dir)  # Trained to the end: backups and lock gone.


def test_across_processes_a_damaged_step_moves_between_two_barriers(
    tmp_path, monkeypatch, uninterrupted
):
    """Every process checks the backups; the chief moves a damaged one only once every
    process has read it (a barrier), and none goes on before it is gone (another): here the
    barriers of a run of 2 processes, recorded with what the directory held at each."""
    from keras_accel.callbacks import backup as backup_module
    from keras_accel.state import backups, recovery
    from keras_accel.utils import process

    backup_dir = str(tmp_path / "backup")
    first = BackupAndRestore(backup_dir, delete_checkpoint=False)
    fit(model(), first, epochs=2)
    sizes = _sizes(first.checkpoints()[-1])
    _flip_64_bytes(max(sizes, key=sizes.get))
    met = []
    # The callback's view only: the engines and the preemption watch stay in one process.
    two = types.SimpleNamespace(**vars(process))
    two.num_processes = lambda: 2
    two.barrier = lambda name, model=None: met.append((name, sorted(os.listdir(backup_dir))))
    for module in (backup_module, backups, recovery):  # The callback and its protocol.
        monkeypatch.setattr(module, "process", two)
    with pytest.warns(UserWarning, match="is damaged"):
        resumed = fit(model(), BackupAndRestore(backup_dir, delete_checkpoint=False))
    monkeypatch.undo()
    names = [name for name, _ in met]
    assert names[:3] == [
        "keras_accel.BackupAndRestore.on_train_begin",
        "keras_accel.BackupAndRestore.damaged",
        "keras_accel.BackupAndRestore.set_aside",
    ]
    before, after = met[1][1], met[2][1]
    assert checksums.DAMAGED not in before and checksums.DAMAGED in after
    assert set(after) - {checksums.DAMAGED} < set(before)  # The damaged step's entries left.
    _assert_same(resumed, uninterrupted)
