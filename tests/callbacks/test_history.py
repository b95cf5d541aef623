"""History: Keras's record, plus timings, files written atomically, and resume."""

import importlib.util
import json
import os
import sys
import uuid

import keras
import pytest

from keras_accel.callbacks import History
from keras_accel.state import files
from keras_accel.utils import process
from tests.callbacks.conftest import BATCH, EPOCHS, ROWS


def test_drop_in_for_keras_history(trained_run):
    history = trained_run.history
    assert trained_run.result is history and trained_run.model.history is history
    assert isinstance(history, keras.callbacks.History)
    assert history.epoch == list(range(EPOCHS))
    for key in ("loss", "accuracy", "w_acc", "val_loss", "val_accuracy", "learning_rate"):
        assert len(history.history[key]) == EPOCHS, key
    assert history.history["learning_rate"] == pytest.approx([0.01] * EPOCHS)


def test_timings_and_throughput(trained_run):
    rows = trained_run.history.rows
    for row in rows:
        assert row["epoch_time"] > 0
        # Real rows (the loss tracker counts them, not the padded last batch's padding) per
        # second over the training part of the epoch, at most the whole epoch.
        assert row["samples_per_second"] >= ROWS / row["epoch_time"] * (1 - 1e-6)


def test_per_step_records(trained_run):
    steps = trained_run.history.steps
    per_epoch = -(-ROWS // BATCH)
    assert [(s["epoch"], s["batch"]) for s in steps] == [
        (e, b) for e in range(EPOCHS) for b in range(per_epoch)
    ]
    assert [s["step"] for s in steps] == list(range(EPOCHS * per_epoch))
    assert all("loss" in s for s in steps)


def test_json_and_csv_on_disk(trained_run):
    history = trained_run.history
    on_disk = json.loads(files.read_text(history.path))
    assert on_disk == json.loads(json.dumps(history.to_dict()))
    loaded = History.load(history.path)
    # pytest.approx takes no dict of lists on every version (pytest 9.2 refuses them): compare
    # the keys, then each metric's list of values.
    assert sorted(loaded.history) == sorted(history.history) and loaded.epoch == history.epoch
    for key, values in history.history.items():
        assert loaded.history[key] == pytest.approx(values), key
    assert loaded.steps == history.steps
    lines = files.read_text(str(trained_run.local / "logs" / "history.csv")).splitlines()
    assert lines[0].split(",")[0] == "epoch" and "val_loss" in lines[0]
    assert len(lines) == 1 + EPOCHS


def _written(path, epochs):
    record = History(path=path)
    for epoch in epochs:
        record.finish_epoch(epoch, {"loss": 1.0 / (epoch + 1)})
    record.write()
    return record


def test_resume_continues_the_record_without_duplicates(tmp_path):
    path = str(tmp_path / "history.json")
    _written(path, range(4))  # A run that finished epochs 0-3 and died in epoch 4.
    resumed = History(path=path)  # A new process, resuming from epoch 2 (its checkpoint).
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    resumed.set_model(model)
    resumed.on_train_begin()
    assert resumed.epoch == [0, 1, 2, 3]  # Picked up from the file.
    resumed.on_epoch_begin(2)
    assert resumed.epoch == [0, 1]  # Epochs 2-3 are about to be trained again.
    resumed.on_epoch_end(2, {"loss": 0.25})
    assert History.load(path).epoch == [0, 1, 2]
    assert History.load(path).history["loss"] == pytest.approx([1.0, 0.5, 0.25])


def test_fresh_fit_from_epoch_zero_replaces_the_record(tmp_path):
    path = str(tmp_path / "history.json")
    _written(path, range(3))
    history = History(path=path)
    history.set_model(keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)]))
    history.on_train_begin()
    history.on_epoch_begin(0)
    assert history.epoch == []


def test_only_the_chief_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "process_index", lambda: 1)
    path = tmp_path / "history.json"
    history = _written(str(path), range(2))
    assert history.epoch == [0, 1]  # Recorded in memory, as on the chief...
    assert not path.exists()  # ...but not written.


def test_remote_path_and_csv_path(tmp_path):
    remote = f"memory://history-{uuid.uuid4().hex[:8]}"
    record = History(path=f"{remote}/run/h.json", csv=f"{remote}/other/h.csv")
    for epoch in range(2):
        record.finish_epoch(epoch, {"loss": 1.0, "val_loss": 2.0})
    record.write()
    assert History.load(f"{remote}/run/h.json").epoch == [0, 1]
    assert files.read_text(f"{remote}/other/h.csv").splitlines()[0].startswith("epoch,loss")
    files.rmtree(remote)


@pytest.mark.torch
@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_record_csv_and_plot_on_object_stores(bucket, request):
    """On local S3 and GCS servers (tests/object_stores.py): the record, its CSV and the plot
    are objects in the bucket, read back; a missing bucket is the store's error, never a
    bucket made for it."""
    root = request.getfixturevalue(bucket)
    record = History(path=f"{root}/run/h.json", csv=True)
    for epoch in range(2):
        record.finish_epoch(epoch, {"loss": 1.0 / (epoch + 1)})
    record.write()
    assert History.load(f"{root}/run/h.json").history["loss"] == [1.0, 0.5]
    assert files.read_text(f"{root}/run/h.csv").splitlines()[0].startswith("epoch,loss")
    if importlib.util.find_spec("matplotlib") is not None:
        assert record.plot(f"{root}/run/curves.png") == f"{root}/run/curves.png"
        assert files.read_bytes(f"{root}/run/curves.png")[:4] == b"\x89PNG"
    missing = f"{files.scheme(root)}://keras-accel-missing-{uuid.uuid4().hex[:8]}"
    lost = History(path=f"{missing}/h.json")
    lost.finish_epoch(0, {"loss": 1.0})
    with pytest.raises(FileNotFoundError):
        lost.write()
    assert not files.exists(missing)


def test_interrupted_write_keeps_the_last_complete_file(tmp_path, monkeypatch):
    path = str(tmp_path / "history.json")
    record = _written(path, range(2))
    record.finish_epoch(2, {"loss": 0.1})

    def killed(source, target):
        raise KeyboardInterrupt

    # Killed with the new record written to its temporary sibling, before the rename.
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        record.write()
    monkeypatch.undo()
    assert History.load(path).epoch == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.json"]


def test_plot(tmp_path, trained_run):
    pytest.importorskip("matplotlib")
    out = trained_run.history.plot(str(tmp_path / "curves.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    remote = f"memory://plot-{uuid.uuid4().hex[:8]}/curves.png"
    trained_run.history.plot(remote)
    assert files.read_bytes(remote)[:4] == b"\x89PNG"
    files.rmtree(files.dirname(remote))


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    record = History()
    record.finish_epoch(0, {"loss": 1.0})
    with pytest.raises(ImportError, match="pip install matplotlib"):
        record.plot("x.png")


def test_bad_files_and_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        History.load(str(tmp_path / "missing.json"))
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(ValueError, match="not a History JSON"):
        History.load(str(tmp_path / "junk.json"))
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="Not a keras_accel History"):
        History.load(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="csv=True"):
        History(csv=True)
    with pytest.raises(TypeError, match="path"):
        History(path=3)
