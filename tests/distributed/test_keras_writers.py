"""Keras's own file-writing callbacks over 2 processes (`keras-accel launch -n 2`, the script
unchanged): one set of files, the chief's, as one process writes them
(keras_accel/state/keras_writers.py); and in the same launch, a tracker's logger and a
`CSVLogger` wrapped in `keras_accel.callbacks.chief_only`, and W&B's `WandbMetricsLogger`
offline as docs/trackers.md sets it up: one run, each epoch once, the logs of one process
(docs/trackers.md)."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import BACKEND
from tests.distributed.test_multi_process import (
    LOCAL_DEVICES,
    TIMEOUT_S,
    TOLERANCE,
    _launch_command,
)

pytestmark = pytest.mark.torch

SCRIPT = os.path.join(os.path.dirname(__file__), "_writers.py")


def _events(directory):
    """{tag: [(step, value)]} of the scalars in every event file under `directory`."""
    import tensorflow as tf

    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(event.step)
    return found


def _written(workdir):
    """What the run's writers left: per TensorBoard directory, how many event files and the
    steps of each scalar; the CSV log's epochs; the checkpoint files."""
    boards = {}
    for name in ("train", "validation"):
        directory = os.path.join(workdir, "tb", name)
        count = len(glob.glob(os.path.join(directory, "events.out.tfevents.*")))
        boards[name] = (count, _events(directory))
    with open(os.path.join(workdir, "log.csv")) as f:
        rows = f.read().splitlines()
    return boards, [row.split(",")[0] for row in rows], sorted(os.listdir(workdir / "ckpt"))


def _runs(folder):
    """The run files a tracker's logger left in `folder`: [[row of each epoch]]."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "run-*.jsonl"))):
        with open(path) as f:
            found.append([json.loads(line) for line in f.read().splitlines()])
    return found


def _wandb_runs(workdir):
    """The offline W&B runs under `workdir`: for each, its history rows (what
    `WandbMetricsLogger` logged, each epoch a row), read from the run's `.wandb` file with
    W&B's own reader (what `wandb sync` reads)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    runs = []
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "*.wandb"))):
        store = datastore.DataStore()
        store.open_for_scan(path)
        rows = []
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key.startswith("epoch/") and key != "epoch/learning_rate":
                    row[key.removeprefix("epoch/")] = json.loads(item.value_json)
            rows.append(row)
        runs.append(rows)
    return runs


def _assert_same_logs(rows, expected):
    assert [row["epoch"] for row in rows] == [row["epoch"] for row in expected] == [0, 1]
    for row, one in zip(rows, expected):
        assert sorted(row) == sorted(one)
        for key in row:
            np.testing.assert_allclose(row[key], one[key], rtol=TOLERANCE, err_msg=key)


def _run(command, workdir, scratch):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(scratch))
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    result = subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


def test_tensorboard_csv_logger_and_model_checkpoint_write_once_over_two_processes(tmp_path):
    """Before: TensorBoard's event files from both processes (every curve twice), CSVLogger's
    rows appended by both; now what one process writes."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    _run([sys.executable, SCRIPT, str(one), "--devices", str(LOCAL_DEVICES)], one, scratch)
    _run(_launch_command(two, script=SCRIPT), two, scratch)

    boards, epochs, checkpoints = _written(two)
    assert (boards, epochs, checkpoints) == _written(one)
    assert boards["train"][1]["epoch_loss"] == [0, 1] and epochs == ["epoch", "0", "1"]
    assert checkpoints == ["model.keras"]
    # Every process's callbacks point where the script put them; no scratch is left.
    for process in (0, 1):
        seen = json.loads((two / f"writers-{process}.json").read_text())
        assert seen == {
            "log_dir": str(two / "tb"),
            "filename": str(two / "log.csv"),
            "filepath": str(two / "ckpt" / "model.keras"),
        }, (process, BACKEND)
    assert not glob.glob(str(scratch / "keras_accel-not-chief-*"))

    # chief_only: one run (the chief's), each epoch once, the global logs one process logs;
    # the same logger bare starts a run in each process, as W&B's and MLflow's do.
    ((tracked,),) = [_runs(two / "tracked")]
    ((alone,),) = [_runs(one / "tracked")]
    _assert_same_logs(tracked, alone)
    assert [len(run) for run in _runs(two / "untracked")] == [2, 2]
    with open(two / "chief.csv") as f, open(one / "chief.csv") as g:
        rows, expected = f.read().splitlines(), g.read().splitlines()
    assert rows[0] == expected[0] and [row.split(",")[0] for row in rows] == ["epoch", "0", "1"]
    columns = rows[0].split(",")
    _assert_same_logs(
        [dict(zip(columns, map(float, row.split(",")))) for row in rows[1:]],
        [dict(zip(columns, map(float, row.split(",")))) for row in expected[1:]],
    )
    # W&B itself, offline, as docs/trackers.md sets it up: one run of two epochs, the
    # global logs (before: a run from each process).
    ((wandb_rows,),) = [_wandb_runs(two)]
    ((wandb_alone,),) = [_wandb_runs(one)]
    _assert_same_logs(wandb_rows, wandb_alone)
