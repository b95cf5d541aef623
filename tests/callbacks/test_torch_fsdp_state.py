"""BackupAndRestore under `strategy="fsdp"` on torch (tests/callbacks/_torch_fsdp_state.py):
each of 2 processes (`keras-accel launch -n 2`) writes its own shards through
torch.distributed.checkpoint, nothing gathered, committed with the checksum record; a fit
stopped mid-epoch resumes exactly (weights, optimizer slots, the epoch's metrics); and a
backup restores onto another process count, 2 -> 1 (fsdp and data_parallel) and 1 -> 2,
and onto data_parallel over 2, with the uninterrupted run's numbers. One launch of two
processes, between the one-process stages run in the test's own process."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="torch's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_fsdp_state.py")
TOLERANCE = 1e-5  # Another process count sums the gradients in another order: float rounding.
BACKUP = "dcp-6"  # The stopped fit's last backup: step 6, 1 batch into epoch 1.


def _run(*command):
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    done = subprocess.run(
        [sys.executable, *command], env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.callbacks import _torch_fsdp_state as stages

    work = tmp_path_factory.mktemp("torch-fsdp-state")
    # The one-process stages run here (a process's start costs more than their fits).
    saved = {"one-0": stages.one(str(work))}
    output = _run("-m", "keras_accel.cli.main", "launch", "-n", "2", SCRIPT, str(work))
    saved["back-0"] = stages.back(str(work))
    for name in ("two-0", "two-1"):
        with np.load(work / f"{name}.npz") as f:
            saved[name] = dict(f)
    return work, saved, output


def _run_of(saved: dict, prefix: str) -> dict:
    return {k[len(prefix) + 1 :]: v for k, v in saved.items() if k.startswith(prefix + "/")}


def _assert_same_run(got: dict, want: dict, atol: float) -> None:
    """Weights and optimizer variables at the end, and the epochs' metrics (the resumed
    fit's History holds the epochs it ran: the last ones)."""
    assert got.keys() == want.keys()
    assert list(got["epochs"]) == [1, 2], got["epochs"]  # It resumed in epoch 1.
    assert any(k.startswith("var/adam/") for k in got)
    for key, value in got.items():
        expected = want[key][-len(value) :] if key.startswith(("history/", "epochs")) else want[key]
        np.testing.assert_allclose(value, expected, rtol=0, atol=atol, err_msg=key)


def test_each_process_writes_its_own_shards_through_dcp(runs, tmp_path):
    import torch.distributed.checkpoint as dcp

    from keras_accel.state import checksums

    work, _, output = runs
    path = work / "two.kept" / BACKUP
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    chunks = {
        key: [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        for key, entry in metadata.state_dict_metadata.items()
        if hasattr(entry, "chunks")
    }
    # Split on its largest dimension 2 divides (JAX's rule): two halves, each written by
    # the process that holds it; a (3,) bias and BatchNormalization's statistics whole, once.
    kernel = "model/sequential/dense/kernel"
    assert chunks[kernel] == [((0, 0), (6, 4)), ((0, 4), (6, 4))]
    for slot in ("momentum", "velocity"):
        assert chunks[f"optimizer/adam/sequential_dense_kernel_{slot}"] == chunks[kernel]
    assert chunks["model/sequential/dense_1/kernel"] == [((0, 0), (4, 3)), ((4, 0), (4, 3))]
    assert chunks["model/sequential/dense_1/bias"] == [((0,), (3,))]
    assert chunks["model/sequential/batch_normalization/moving_mean"] == [((0,), (8,))]
    writers = {}
    for index, place in metadata.storage_data.items():
        writers.setdefault(index.fqn, {})[tuple(index.offset)] = place.relative_path
    split = [key for key, parts in chunks.items() if len(parts) == 2]
    # dense's kernel and bias, BatchNormalization's gamma and beta, dense_1's kernel; and
    # Adam's 2 slots of each.
    assert len(split) == 5 * 3
    for key in split:
        offsets = [offset for offset, _ in chunks[key]]
        assert writers[key] == {offsets[0]: "__0_0.distcp", offsets[1]: "__1_0.distcp"}, key
    # Committed with the checksum record of both processes' files, checked at a restore.
    assert checksums.verify(str(path)) is True
    damaged = tmp_path / BACKUP
    shutil.copytree(path, damaged)
    with open(damaged / "__1_0.distcp", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(checksums.Damaged, match="__1_0.distcp"):
        checksums.verify(str(damaged))
    # The weight that stays whole (no dimension 2 divides) is said, by the chief, once a fit.
    note = "fsdp keeps 1 weight(s) whole in every process, no dimension being a multiple of"
    assert output.count(note) == 4 and "sequential/dense_1/bias (3,)." in output, output[-3000:]


def test_a_stopped_fsdp_fit_resumes_exactly(runs):
    """Stopped after step 8, resumed from step 6's backup (mid-epoch: the epoch's first
    batch runs again, then the backup's state is assigned to the shards): the weights and
    optimizer slots bit for bit, the epoch's metrics (each process's share of their state
    restored) within float rounding."""
    _, saved, _ = runs
    for process in ("two-0", "two-1"):
        resumed = _run_of(saved[process], "two/resumed")
        straight = _run_of(saved[process], "two/straight")
        _assert_same_run(resumed, straight, atol=1e-6)
        for key in resumed:
            if key.startswith("var/"):
                np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


@pytest.mark.parametrize(
    "run, uninterrupted",
    [
        ("back-0:two_to_one/fsdp", "two-0:two/straight"),
        ("back-0:two_to_one/data_parallel", "two-0:two/straight"),
        ("two-0:one_to_two", "one-0:one/straight"),
        ("two-1:one_to_two", "one-0:one/straight"),
        ("two-1:two_to_data_parallel", "two-1:two/straight"),
    ],
    ids=["2-to-1-fsdp", "2-to-1-data_parallel", "1-to-2-fsdp", "1-to-2-second", "2-to-2-dp"],
)
def test_a_backup_restores_onto_another_process_count(runs, run, uninterrupted):
    _, saved, _ = runs
    (process, prefix), (other, reference) = run.split(":"), uninterrupted.split(":")
    _assert_same_run(_run_of(saved[process], prefix), _run_of(saved[other], reference), TOLERANCE)
