"""Exact resume, proven: SIGKILL a training process mid-epoch, start it again, and end with
the weights, History and learning rates of a run that was never interrupted.

Each run is its own process (tests/callbacks/_resume_script.py) on the backend under test,
with 8 virtual CPU devices, seeded, training through `Accelerator.fit` with
BackupAndRestore(save_freq=3 batches, saving in the background), History(per_step=True) and
a step-mode LearningRateScheduler. Run B kills itself right after the backup of step 12
(batch 4 of epoch 1, 0-based) was handed to the engine, while that save is still being
written: the resumed process restores step 12 if the engine committed it in time, else
step 9, re-runs the epoch's first batches up to that position, restores, and continues.
Either way it must end exactly where the uninterrupted run ends.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import BackupAndRestore, run_context
from keras_accel.schedules import PiecewiseConstant
from tests.gcs_emulator import gcs_like_google  # noqa: F401 (a fixture, for gs://)
from tests.helpers import FEW_REPLICAS, compiled_mlp, data

pytestmark = pytest.mark.torch  # Also on KERAS_BACKEND=torch: one process, one device.

SCRIPT = pathlib.Path(__file__).with_name("_resume_script.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]
EPOCHS, STEPS_PER_EPOCH = 3, 7


def _start(workdir, name, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(workdir), name, *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(run, timeout=400):
    output, _ = run.communicate(timeout=timeout)
    return run.returncode, output


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path, backend):
    # The uninterrupted run and the first half of the killed one run side by side.
    uninterrupted = _start(tmp_path, "A")
    killed = _start(tmp_path, "B", "1:4")
    code, output = _finish(killed)
    assert code == -signal.SIGKILL, output
    backups = sorted(os.listdir(tmp_path / "B.backup"))
    # Orbax numbers its step directories, tf.train its ckpt-<step> files, DCP dcp-<step>
    # directories; step 9 (2 batches into epoch 1) was complete before step 12's save began.
    assert {"9", "ckpt-9.index", "dcp-9"} & set(backups), backups
    assert [
        row["epoch"] for row in json.loads((tmp_path / "B.history.json").read_text())["epochs"]
    ] == [0]
    resumed = _start(tmp_path, "B")
    code, output = _finish(uninterrupted)
    assert code == 0, output
    code, output = _finish(resumed)
    assert code == 0, output
    assert "stale lock" in output  # The killed process's lock, taken over.

    a, b = np.load(tmp_path / "A.weights.npz"), np.load(tmp_path / "B.weights.npz")
    assert a.files == b.files
    for key in a.files:
        np.testing.assert_allclose(b[key], a[key], atol=1e-6, rtol=0, err_msg=key)
    assert int(b["iterations"]) == EPOCHS * STEPS_PER_EPOCH

    history_a = json.loads((tmp_path / "A.history.json").read_text())
    history_b = json.loads((tmp_path / "B.history.json").read_text())
    assert [row["epoch"] for row in history_b["epochs"]] == list(range(EPOCHS))
    steps = history_b["steps"]
    assert [row["step"] for row in steps] == list(range(EPOCHS * STEPS_PER_EPOCH))
    # The learning rate continued the schedule at the right step after the resume.
    schedule = PiecewiseConstant([0.1, 0.03, 0.01], boundaries=[0.3, 0.6], unit="fraction")
    schedule = schedule.with_total_steps(EPOCHS * STEPS_PER_EPOCH)
    expected = [float(schedule(row["step"])) for row in steps]
    assert [row["learning_rate"] for row in steps] == pytest.approx(expected, abs=1e-7)
    # Losses and metrics, per step and per epoch, are the uninterrupted run's.
    for row_a, row_b in zip(history_a["steps"], steps, strict=True):
        assert row_b["loss"] == pytest.approx(row_a["loss"], abs=1e-5)
    for row_a, row_b in zip(history_a["epochs"], history_b["epochs"], strict=True):
        for key in ("loss", "accuracy", "learning_rate"):
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-5), (row_b["epoch"], key)
    assert not (tmp_path / "B.backup").exists()  # Deleted once training completed.


# The engines that a local GCS emulator reaches: Orbax writes gs:// itself (tensorstore for
# the arrays, gcsfs through etils for the rest), DCP through gcsfs. TensorFlow's own GCS
# client has Google's endpoint compiled in.
GS_BACKENDS = {"jax", "torch"}


# The committed step a killed run certainly left: 9, complete before step 12's save began.
STEP_9 = {"s3": {"orbax-9", "tf-9", "dcp-9"}, "gs": {"9", "dcp-9"}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "store, signum",
    [
        ("s3", signal.SIGKILL),
        ("gs", signal.SIGKILL),
        # A preemption on one backend (JAX: the staged save at SIGTERM must be uploaded and
        # committed before the process exits; a local SIGTERM is tests/callbacks/test_backup.py's).
        ("s3", signal.SIGTERM),
    ],
    ids=["s3-SIGKILL", "gs-SIGKILL", "s3-SIGTERM"],
)
def test_stopped_run_with_its_backup_in_a_bucket_resumes_exactly(
    request, tmp_path, store, signum, backend
):
    """The same kill in a bucket of a local server (moto's S3, gcp-storage-emulator's GCS):
    Orbax and tf.train stage each s3:// save locally and upload it, Orbax writes gs:// in
    place, DCP writes through s3fs. The killed save is either committed (its marker) or named
    interrupted and removed; a SIGTERM saves the step it stops at and exits 143. The end is
    the same."""
    from keras_accel.state import files

    if store == "gs" and backend not in GS_BACKENDS:
        pytest.skip(f"no gs:// emulator run for {backend}'s engine (see GS_BACKENDS)")
    if signum == signal.SIGTERM and backend != "jax":
        pytest.skip("SIGTERM into a bucket runs on JAX only (the suite's budget)")
    if store == "gs":
        request.getfixturevalue("gcs_like_google")
    bucket = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[store])
    root = f"backup_root={bucket}"
    uninterrupted = _start(tmp_path, "A")
    stopped = _start(tmp_path, "B", "1:4", root, f"kill_with={signum.name}")
    code, output = _finish(stopped)
    backups = files.listdir(f"{bucket}/B.backup")
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL, output
        assert STEP_9[store] & set(backups), backups
    else:
        assert code == 143, output  # keras_accel.callbacks.Preempted
        # Stopped at the next batch end (step 13 here), that step saved and committed.
        saved = re.search(r"SIGTERM \(preemption\) reached every process; saved (\S+)\.", output)
        assert saved, output
        assert saved[1].startswith(f"{bucket}/B.backup/orbax-"), saved[1]
        assert int(saved[1].rsplit("-", 1)[1]) > 12 and saved[1].rsplit("/")[-1] in backups
        assert not any(name.endswith(".lock") for name in backups), backups  # Let go.
    resumed = _start(tmp_path, "B", root)
    code, output = _finish(uninterrupted)
    assert code == 0, output
    code, output = _finish(resumed)
    assert code == 0, output
    if signum == signal.SIGKILL:
        assert "stale lock" in output
    else:
        assert "stale lock" not in output and "still being written" not in output, output
    a, b = np.load(tmp_path / "A.weights.npz"), np.load(tmp_path / "B.weights.npz")
    assert a.files == b.files
    for key in a.files:
        np.testing.assert_allclose(b[key], a[key], atol=1e-6, rtol=0, err_msg=key)
    assert int(b["iterations"]) == EPOCHS * STEPS_PER_EPOCH
    assert not files.exists(f"{bucket}/B.backup")  # Deleted once training completed.
    assert files.listdir(bucket) == []  # Nothing else was left behind.


NAMED = "named=enc,bn,drop,head"


@pytest.mark.slow
def test_a_crashed_run_resumes_after_its_last_epoch_into_layers_made_in_another_order(
    tmp_path, backend
):
    """An exception ends fit (and the process) right after the backup of epoch 1 was handed
    to the engine, in the background; the next script creates the same named layers in
    another order. It must resume at epoch 2 from that backup, by variable path, and end
    exactly where the uninterrupted run ends. (Orbax's background save used to die with the
    interpreter: the run went back to epoch 1, or to epoch 0 with fresh weights, silently.)"""
    uninterrupted = _start(tmp_path, "N", NAMED, "save_freq=epoch")
    crashed = _start(tmp_path, "C", NAMED, "save_freq=epoch", "raise_after=1")
    code, output = _finish(crashed)
    assert code == 1 and "RuntimeError: Crash after epoch 1" in output, output
    backups = sorted(os.listdir(tmp_path / "C.backup"))
    # One backup per epoch end, numbered by step: 7 and 14, both committed.
    assert any(
        {f"{prefix}7{suffix}", f"{prefix}14{suffix}"} <= set(backups)
        for prefix, suffix in (("", ""), ("ckpt-", ".index"), ("dcp-", ""))
    ), backups
    resumed = _start(tmp_path, "C", "named=head,drop,bn,enc", "save_freq=epoch")
    code, output = _finish(resumed)
    assert code == 0, output
    code, output = _finish(uninterrupted)
    assert code == 0, output

    # The epochs each process began: the resumed one starts at epoch 2.
    assert (tmp_path / "C.epochs").read_text().split("\n")[1:] == ["0 1", "2"]
    history = json.loads((tmp_path / "C.history.json").read_text())
    assert [row["epoch"] for row in history["epochs"]] == list(range(EPOCHS))
    a, c = np.load(tmp_path / "N.weights.npz"), np.load(tmp_path / "C.weights.npz")
    assert sorted(a.files) == sorted(c.files)
    assert "enc|kernel" in a.files and "head|kernel" in a.files
    for key in a.files:  # Bit for bit: the restore is exact, the rest deterministic.
        np.testing.assert_array_equal(c[key], a[key], err_msg=key)
    assert int(c["iterations"]) == EPOCHS * STEPS_PER_EPOCH


# ---------------------------------------------------------------- an epoch begun late
# In one process, fast: a fit of 3 epochs stopped by an exception right after the backup of
# batch k of epoch 1 (the fit lets go of the directory at once), then the same fit again on
# a model built afresh. The resumed fit begins epoch 1 at batch k: it runs none of the batches
# before (the old way re-ran them and restored again), its callbacks see the uninterrupted
# run's batch numbers, the epoch's mean loss is the whole epoch's, the weights are the
# uninterrupted run's bit for bit.

LATE_ROWS, LATE_BATCH = 52, 8  # 7 batches an epoch, the last one padded.


class _Stop(Exception):
    pass


class _Seen(keras.callbacks.Callback):
    """The batches whose ends the callbacks see, and the epochs' logs; stops the fit (an
    exception) at the end of `stop_at` = (epoch, batch)."""

    def __init__(self, stop_at=None):
        super().__init__()
        self.stop_at, self.batches, self.logs, self.replayed = stop_at, [], {}, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if run_context(self.model).replaying(self.epoch, batch):
            self.replayed += 1
            return
        self.batches.append((self.epoch, batch))
        if (self.epoch, batch) == self.stop_at:
            raise _Stop

    def on_epoch_end(self, epoch, logs=None):
        self.logs[epoch] = dict(logs)


class _Rows(keras.utils.PyDataset):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y

    def __len__(self):
        return -(-len(self.x) // LATE_BATCH)

    def __getitem__(self, index):
        cut = slice(index * LATE_BATCH, (index + 1) * LATE_BATCH)
        return self.x[cut], self.y[cut]


def _late_fit(tmp_path, name, inputs, seen):
    # TensorFlow traces every step once per replica: two take every cross-replica path of a
    # resume (`FEW_REPLICAS`; 74 s for the arrays case on 8 beside the suite).
    tf = keras.backend.backend() == "tensorflow"
    acc = Accelerator(seed=0, devices=FEW_REPLICAS if tf else None)
    with acc.scope():
        model = compiled_mlp(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), dropout=True)
    x, y = data(LATE_ROWS)
    data_args = (x, y) if inputs == "arrays" else (_Rows(x, y), None)
    backup = BackupAndRestore(str(tmp_path / f"{name}.backup"), save_freq=1)
    try:
        acc.fit(
            model,
            *data_args,
            batch_size=LATE_BATCH if inputs == "arrays" else None,
            epochs=3,  # The epoch after the late one begins as it should.
            verbose=0,
            callbacks=[backup, seen],
        )
    except _Stop:
        return None
    return [np.asarray(w) for w in model.get_weights()] + [np.asarray(model.optimizer.iterations)]


@pytest.mark.parametrize(
    "inputs, stops", [("arrays", (1, 3, 6)), ("pydataset", (3,))], ids=["arrays", "pydataset"]
)
def test_a_resumed_epoch_begins_at_its_backup(tmp_path, backend, num_devices, inputs, stops):
    keys = None  # Every metric (TensorFlow on one device: built before the restore too).
    # TensorFlow on one device reads a PyDataset through Keras's own adapter, whose epoch a
    # loop stopped before the data's end leaves open: its first batches are replayed.
    replays = backend == "tensorflow" and num_devices == 1 and inputs == "pydataset"
    whole = _Seen()
    expected = _late_fit(tmp_path, "whole", inputs, whole)
    for done in stops:  # The backup after `done` batches: the first, the middle, the last but one.
        name = f"stopped{done}"
        assert _late_fit(tmp_path, name, inputs, _Seen(stop_at=(1, done - 1))) is None
        resumed = _Seen()
        weights = _late_fit(tmp_path, name, inputs, resumed)
        # Batches 0..done-1 of epoch 1 never ran again (or, replayed, no callback saw them).
        assert resumed.batches == [(e, b) for e in (1, 2) for b in range(7) if e == 2 or b >= done]
        assert resumed.replayed == (done if replays else 0), done
        for a, b in zip(expected, weights, strict=True):
            np.testing.assert_array_equal(b, a, err_msg=f"stopped after {done}")
        # The epoch's logs are the whole epoch's (the first batches' share from the backup;
        # under a MirroredStrategy the replicas' metric totals add up in another order).
        expected_logs = {k: whole.logs[1][k] for k in keys or whole.logs[1]}
        logs = {k: resumed.logs[1][k] for k in expected_logs}
        assert logs == pytest.approx(expected_logs, rel=1e-6, abs=0), done
