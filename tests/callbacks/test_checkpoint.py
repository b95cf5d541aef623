"""ModelCheckpoint, and .weights.h5 / .keras files under distribution on both backends."""

import os
import uuid

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import ModelCheckpoint, _saving
from keras_accel.state import files
from keras_accel.utils import process
from tests.callbacks.conftest import EPOCHS
from tests.helpers import assert_weights_close, compiled_mlp, data


def test_rotation_keeps_the_newest_files_on_remote_storage(trained_run):
    assert files.listdir(f"{trained_run.remote}/ckpt") == ["e02.weights.h5", "e03.weights.h5"]
    # 6 batches per epoch, a save every 4 batches: after batches 4, 8, 12, 16 (counted
    # across epochs), named with Keras's 1-based epoch and batch: b1-4, b2-2, b2-6, b3-4.
    assert files.listdir(f"{trained_run.remote}/steps") == [
        "b2-2.weights.h5",
        "b2-6.weights.h5",
        "b3-4.weights.h5",
    ]


def test_files_load_back_under_distribution(trained_run):
    acc = trained_run.acc
    with acc.scope():
        model = trained_run.build()
        model.optimizer.build(model.trainable_variables)
        with files.local_copy(f"{trained_run.remote}/ckpt/e{EPOCHS:02d}.weights.h5") as local:
            model.load_weights(local)
        # Safe mode: the default of load_model, stated here because it is the point.
        loaded = keras.saving.load_model(str(trained_run.local / "last.keras"), safe_mode=True)
    assert_weights_close(trained_run.weights, [np.asarray(w) for w in model.get_weights()])
    assert_weights_close(trained_run.weights, [np.asarray(w) for w in loaded.get_weights()])
    # Its variables are laid out over every replica, as if built in the scope. (A second
    # Accelerator: the first one's recompile guard is warm and would count a new model.)
    other = Accelerator(seed=0)
    other.prepare(loaded)
    np.testing.assert_allclose(
        other.predict(loaded, trained_run.x, verbose=0),
        acc.predict(trained_run.model, trained_run.x, verbose=0),
        atol=1e-5,
    )


def test_save_best_only_follows_the_monitor(trained_run):
    val_loss = trained_run.history.history["val_loss"]
    best = trained_run.local / "best"
    improved = [e for e in range(EPOCHS) if val_loss[e] == min(val_loss[: e + 1])]
    expected = sorted(f"e{e + 1}-{val_loss[e]:.3f}.keras" for e in improved)
    assert sorted(os.listdir(best)) == expected
    assert trained_run.checkpoints["best"].best == pytest.approx(min(val_loss))


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_save_and_load_under_distribution(suffix, tmp_path, num_devices):
    """The seed's failure: HDF5 weights of a distributed model. Here both formats, to a
    local path and to memory://, from a model built in the scope of 8 replicas."""
    acc = Accelerator(seed=0)
    with acc.scope():
        model = compiled_mlp()
    assert acc.num_replicas == num_devices
    weights_only = suffix == ".weights.h5"
    targets = [str(tmp_path / f"m{suffix}"), f"memory://save-{uuid.uuid4().hex[:8]}/m{suffix}"]
    for target in targets:
        _saving.save(model, target, weights_only=weights_only)
        with acc.scope():
            if weights_only:
                other = compiled_mlp(seed=5)
                with files.local_copy(target) as local:
                    other.load_weights(local)
            else:
                with files.local_copy(target) as local:
                    other = keras.saving.load_model(local, safe_mode=True)
        assert_weights_close(
            [np.asarray(w) for w in model.get_weights()],
            [np.asarray(w) for w in other.get_weights()],
            atol=0,
        )
    assert os.listdir(tmp_path) == [f"m{suffix}"]  # No temporary file left.
    files.rmtree(files.dirname(targets[1]))


def test_only_the_chief_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "process_index", lambda: 3)
    model = compiled_mlp()
    checkpoint = ModelCheckpoint(str(tmp_path / "e{epoch}.keras"), monitor="loss")
    checkpoint.set_model(model)
    checkpoint.on_epoch_begin(0)
    checkpoint.on_epoch_end(0, {"loss": 0.5})
    assert os.listdir(tmp_path) == []


def test_the_others_save_a_scratch_copy_deleted_at_once(tmp_path, monkeypatch):
    # What docs/multi_host.md says of a process other than the chief: it saves too (reading
    # the state can be a collective), into a local temporary directory, gone once written.
    monkeypatch.setattr(process, "process_index", lambda: 1)
    saved = []
    save = _saving.save

    def recorded(model, target, **kwargs):
        save(model, target, **kwargs)
        saved.append((target, os.path.exists(target)))

    monkeypatch.setattr(_saving, "save", recorded)
    checkpoint = ModelCheckpoint(str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True)
    checkpoint.set_model(compiled_mlp())
    checkpoint.on_epoch_begin(0)
    checkpoint.on_epoch_end(0, {"loss": 0.5})
    [(target, written)] = saved
    assert written and os.path.basename(target) == "e1.weights.h5"
    assert not target.startswith(str(tmp_path)) and not os.path.exists(os.path.dirname(target))
    assert os.listdir(tmp_path) == []


def test_rotation_counts_older_matching_files(tmp_path):
    model = compiled_mlp()
    for name in ("e1.weights.h5", "e2.weights.h5", "unrelated.txt"):
        (tmp_path / name).write_bytes(b"old")
        os.utime(tmp_path / name, (1, 1))  # Older than anything saved now.
    checkpoint = ModelCheckpoint(
        str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True, max_to_keep=2
    )
    checkpoint.set_model(model)
    for epoch in (2, 3):  # Files e3, e4.
        checkpoint.on_epoch_begin(epoch)
        checkpoint.on_epoch_end(epoch, {"loss": 1.0})
    assert sorted(os.listdir(tmp_path)) == ["e3.weights.h5", "e4.weights.h5", "unrelated.txt"]


@pytest.mark.torch
@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_files_and_rotation_on_object_stores(bucket, request):
    """On local S3 and GCS servers (tests/object_stores.py): each epoch's file is an object,
    rotation keeps the newest two (listed and dated by the store), the newest loads back to
    the model's weights; a missing bucket is the store's error, never a bucket made for it."""
    root = request.getfixturevalue(bucket)
    model = compiled_mlp()
    model.set_weights([w + 0.5 for w in model.get_weights()])  # Unlike a fresh model's.
    checkpoint = ModelCheckpoint(
        f"{root}/ckpt/e{{epoch}}.weights.h5", save_weights_only=True, max_to_keep=2
    )
    checkpoint.set_model(model)
    for epoch in range(3):  # Files e1, e2, e3.
        checkpoint.on_epoch_begin(epoch)
        checkpoint.on_epoch_end(epoch, {"loss": 1.0})
    assert files.listdir(f"{root}/ckpt") == ["e2.weights.h5", "e3.weights.h5"]
    restored = compiled_mlp()
    with files.local_copy(f"{root}/ckpt/e3.weights.h5") as local:
        restored.load_weights(local)
    assert_weights_close(restored.get_weights(), model.get_weights(), atol=0)
    missing = f"{files.scheme(root)}://keras-accel-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(FileNotFoundError):
        _saving.save(model, f"{missing}/model.keras", weights_only=False)
    assert not files.exists(missing)


def test_a_crash_while_saving_keeps_the_previous_file(tmp_path, monkeypatch):
    model = compiled_mlp()
    target = tmp_path / "model.weights.h5"
    _saving.save(model, str(target), weights_only=True)
    before = target.read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "save_weights", killed)
    with pytest.raises(KeyboardInterrupt):
        _saving.save(model, str(target), weights_only=True)
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.weights.h5"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep"):
        ModelCheckpoint(str(tmp_path / "m.keras"), max_to_keep=0)
    with pytest.raises(ValueError, match=".weights.h5"):  # Keras's own check, kept.
        ModelCheckpoint(str(tmp_path / "m.keras"), save_weights_only=True)
    (tmp_path / "dir.keras").mkdir()
    with pytest.raises(IsADirectoryError, match="existing directory"):
        _saving.save(compiled_mlp(), str(tmp_path / "dir.keras"), weights_only=False)


def test_verbose_prints_keras_messages_and_saves(tmp_path, capsys):
    """verbose=1 used to raise after writing the file, which aborted fit."""
    path = tmp_path / "e{epoch}.weights.h5"
    model = compiled_mlp()
    model.fit(
        *data(16),
        epochs=1,
        verbose=0,
        callbacks=[ModelCheckpoint(str(path), save_weights_only=True, verbose=1)],
    )
    saved = str(tmp_path / "e1.weights.h5")
    assert os.listdir(tmp_path) == ["e1.weights.h5"]
    assert capsys.readouterr().out == (
        f"\nEpoch 1: saving model to {saved}\n\nEpoch 1: finished saving model to {saved}\n"
    )


def test_existing_directory_error_keeps_keras_wording(tmp_path):
    (tmp_path / "dir.keras").mkdir()
    checkpoint = ModelCheckpoint(str(tmp_path / "dir.keras"), monitor="loss")
    checkpoint.set_model(compiled_mlp())
    checkpoint.on_epoch_begin(0)
    with pytest.raises(
        IOError,
        match=r"^Please specify a non-directory filepath for "
        r"ModelCheckpoint\. Filepath used is an existing directory: .*dir\.keras",
    ):
        checkpoint.on_epoch_end(0, {"loss": 0.5})


class _Scores(keras.callbacks.Callback):
    """Puts a chosen `score` into each epoch's logs (before the checkpoint reads them), and
    records the weights each epoch ended with."""

    SCORES = [0.5, 0.3, 0.4, 0.35]  # Epoch 1 is the best; 2 and 3 are worse.

    def __init__(self):
        super().__init__()
        self.weights = {}

    def on_epoch_end(self, epoch, logs=None):
        logs["score"] = self.SCORES[epoch]
        self.weights[epoch] = self.model.get_weights()


@pytest.mark.parametrize("backup_first", [True, False], ids=["backup_first", "checkpoint_first"])
def test_a_resumed_run_keeps_the_best_of_the_run_before(tmp_path, backup_first):
    """`best` travels with the backup: after a resume at epoch 2 neither worse epoch
    overwrites epoch 1's file, whichever callback's epoch end runs first."""
    from keras_accel.callbacks import BackupAndRestore
    from tests.helpers import Interrupt

    # One backup callback for both runs, as in one process: the interrupted fit's lock is
    # its own (Keras skips on_train_end when fit raises).
    backup = BackupAndRestore(str(tmp_path / "backup"))

    def run(scores, *extra):
        keras.backend.clear_session(free_memory=False)
        model = compiled_mlp()
        checkpoint = ModelCheckpoint(
            str(tmp_path / "best.weights.h5"),
            monitor="score",
            mode="min",
            save_best_only=True,
            save_weights_only=True,
        )
        every = ModelCheckpoint(str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True)
        pair = [backup, checkpoint, every] if backup_first else [checkpoint, every, backup]
        x, y = data(40)
        try:
            model.fit(x, y, epochs=4, verbose=0, callbacks=[scores, *pair, *extra])
        finally:
            backup.wait()
        return checkpoint

    first, resumed = _Scores(), _Scores()
    with pytest.raises(KeyboardInterrupt):
        run(first, Interrupt(2))
    checkpoint = run(resumed)
    assert sorted(first.weights) == [0, 1] and sorted(resumed.weights) == [2, 3]
    assert checkpoint.best == pytest.approx(0.3)
    saved = compiled_mlp()
    saved.load_weights(str(tmp_path / "best.weights.h5"))
    # Still epoch 1's file: the epochs after the resume were not better.
    for got, want in zip(saved.get_weights(), first.weights[1]):
        np.testing.assert_array_equal(got, want)
