"""BackupAndRestore: what is saved, how it is found again, and every way it can go wrong."""

import json
import os
import pathlib
import random
import re
import subprocess
import sys
import uuid
import warnings

import keras
import numpy as np
import pytest

from keras_accel import io
from keras_accel.callbacks import BackupAndRestore, History
from keras_accel.callbacks._lock import LOCK_NAME
from keras_accel.utils import process
from tests.helpers import compiled_mlp, data, weights_of


class Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt


def test_interrupted_fit_resumes_where_it_stopped_on_remote_storage():
    """Keras's own example, on memory://: the second fit runs only the missing epochs and
    the History record continues, with every epoch once."""
    backup_dir = f"memory://backup-{uuid.uuid4().hex[:8]}"
    x, y = data(40)
    model = compiled_mlp()
    history = History(path=f"{backup_dir}-history.json")
    backup = BackupAndRestore(backup_dir)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, history, Interrupt(2)])
    names = io.listdir(backup_dir)
    assert names == [LOCK_NAME, "ckpt-e000001-b00000000", "ckpt-e000002-b00000000"]

    # A new process: fresh objects, same model definition.
    keras.backend.clear_session(free_memory=False)
    model = compiled_mlp(seed=7)  # Different initial weights: the backup must win.
    history = History(path=f"{backup_dir}-history.json")
    with warnings.catch_warnings():
        # Same process, same callback object: its own lock is no "stale lock".
        warnings.simplefilter("error", UserWarning)
        result = model.fit(x, y, epochs=4, verbose=0, callbacks=[history, backup], initial_epoch=0)
    assert result is history
    assert history.epoch == [0, 1, 2, 3]
    assert len(history.history["loss"]) == 4
    # 2 steps per epoch: 4 restored with the optimizer, 4 trained now, none doubled.
    assert model.optimizer.iterations.numpy() == 4 * 2
    assert not io.exists(backup_dir)  # delete_checkpoint=True removes everything.
    assert model._initial_epoch is None  # A later fit starts where it is told to.
    io.remove(f"{backup_dir}-history.json")


def _compiled_and_built(**kwargs):
    model = compiled_mlp(**kwargs)
    model.optimizer.build(model.trainable_variables)
    return model


def _start(backup, model, steps=3, epochs=5):
    backup.set_model(model)
    backup.set_params({"epochs": epochs, "steps": steps, "verbose": 0})
    backup.on_train_begin()


def _shift(model, amount):
    for variable in model.trainable_variables:
        variable.assign(variable.numpy() + amount)


def test_restores_weights_optimizer_rng_and_position(tmp_path):
    model = _compiled_and_built()
    model.optimizer.iterations.assign(7)
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, model)
    random.seed(3)
    np.random.seed(3)
    expected_draws = (random.random(), np.random.rand())
    random.seed(3)
    np.random.seed(3)
    backup.save(epoch=2, batch=1)  # One batch into epoch 3.
    expected = weights_of(model)
    backup.on_train_end()

    other = _compiled_and_built(seed=9)
    restored = BackupAndRestore(str(tmp_path))
    _start(restored, other)
    assert [np.array_equal(a, b) for a, b in zip(weights_of(other), expected)] == [True] * len(
        expected
    )
    assert int(other.optimizer.iterations.numpy()) == 7
    assert other._initial_epoch == 2
    assert (random.random(), np.random.rand()) == expected_draws
    restored.on_train_end()


def test_partial_and_corrupt_latest_fall_back_to_the_previous(tmp_path):
    model = _compiled_and_built()
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, model)
    backup.save(1, 0)
    good = weights_of(model)
    _shift(model, 1.0)
    corrupt = backup.save(2, 0)
    _shift(model, 1.0)
    backup.on_train_end()
    # The newest one has damaged data; a still newer one never got its marker (killed).
    with open(os.path.join(corrupt, "variables.npz"), "r+b") as f:
        f.seek(100)
        f.write(b"\0garbage\0")
    partial = tmp_path / "ckpt-e000003-b00000000"
    partial.mkdir()
    (partial / "variables.npz").write_bytes(b"half")

    other = _compiled_and_built(seed=4)
    restored = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    with pytest.warns(UserWarning) as caught:
        _start(restored, other)
    messages = " | ".join(str(w.message) for w in caught)
    assert "incomplete backup" in messages and "ckpt-e000003" in messages
    assert "checksum" in messages and "ckpt-e000002" in messages
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(other), good))
    assert other._initial_epoch == 1
    # The next save replaces the failed ones and rotation removes the partial directory.
    restored.save(2, 0)
    assert sorted(restored.checkpoints()) == [
        str(tmp_path / "ckpt-e000001-b00000000"),
        str(tmp_path / "ckpt-e000002-b00000000"),
    ]
    assert not partial.exists()
    restored.on_train_end()


def test_nothing_usable_is_an_error_and_nothing_is_deleted(tmp_path):
    model = _compiled_and_built()
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, model)
    path = backup.save(1, 0)
    backup.on_train_end()
    (tmp_path / "ckpt-e000001-b00000000" / "state.json").write_text("{}")
    restored = BackupAndRestore(str(tmp_path))
    with pytest.warns(UserWarning, match="checksum"), pytest.raises(RuntimeError, match="none"):
        _start(restored, _compiled_and_built())
    assert os.path.isdir(path) and not (tmp_path / LOCK_NAME).exists()


def test_a_different_model_names_the_variable_and_changes_nothing(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, _compiled_and_built())
    path = backup.save(1, 0)
    backup.on_train_end()
    before = {name: (tmp_path / path / name).read_bytes() for name in os.listdir(path)}

    wider = keras.Sequential(  # compiled_mlp's layers, but 32 units instead of 16.
        [
            keras.Input((6,)),
            keras.layers.Dense(32, name="wide"),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(3),
        ]
    )
    wider.compile("sgd", "sparse_categorical_crossentropy")
    wider.optimizer.build(wider.trainable_variables)
    initial = weights_of(wider)
    restored = BackupAndRestore(str(tmp_path))
    with pytest.raises(ValueError) as error:
        _start(restored, wider)
    message = str(error.value)
    assert "wide/kernel" in message and "(6, 32)" in message and "(6, 16)" in message
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(wider), initial))
    assert {name: (tmp_path / path / name).read_bytes() for name in os.listdir(path)} == before
    assert not (tmp_path / LOCK_NAME).exists()  # Released: the run can be fixed and rerun.

    shallower = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, name="only")])
    shallower.compile("sgd", "mse")
    with pytest.raises(ValueError, match=r"holds 8 model variables, this model has 2.*only"):
        _start(BackupAndRestore(str(tmp_path)), shallower)


def test_rotation_keeps_max_to_keep(tmp_path):
    backup = BackupAndRestore(str(tmp_path), max_to_keep=2, delete_checkpoint=False)
    _start(backup, _compiled_and_built())
    for epoch in range(1, 5):
        backup.save(epoch, 0)
    assert [os.path.basename(p) for p in backup.checkpoints()] == [
        "ckpt-e000003-b00000000",
        "ckpt-e000004-b00000000",
    ]
    backup.on_train_end()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-e000003-b00000000", "ckpt-e000004-b00000000"]


def test_mid_epoch_backup_needs_the_same_epoch_length(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, _compiled_and_built(), steps=10)
    backup.save(1, 4)
    backup.on_train_end()
    with pytest.raises(ValueError, match=r"4 batches into epoch 2, with 10 batches.*has 7"):
        _start(BackupAndRestore(str(tmp_path)), _compiled_and_built(), steps=7)


def test_backup_dir_that_is_a_file(tmp_path):
    target = tmp_path / "not_a_dir"
    target.write_text("precious")
    with pytest.raises(NotADirectoryError, match="is a file"):
        _start(BackupAndRestore(str(target)), _compiled_and_built())
    with pytest.raises(NotADirectoryError, match="a part of it is a file"):
        _start(BackupAndRestore(str(target / "sub")), _compiled_and_built())
    remote = f"memory://file-{uuid.uuid4().hex[:8]}"
    io.write_bytes(remote, b"precious")
    with pytest.raises(NotADirectoryError, match="is a file"):
        _start(BackupAndRestore(remote), _compiled_and_built())
    assert target.read_text() == "precious" and io.read_bytes(remote) == b"precious"
    io.remove(remote)


def _unwritable(tmp_path):
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return str(locked / "backup")
    # root ignores permission bits; sysfs refuses new entries even to root.
    if os.path.isdir("/sys/kernel"):
        return "/sys/kernel/keras_accel_backup"
    pytest.skip("no unwritable location available")


def test_unwritable_backup_dir(tmp_path):
    with pytest.raises(PermissionError, match="cannot create or write backup_dir"):
        _start(BackupAndRestore(_unwritable(tmp_path)), _compiled_and_built())


def test_two_runs_on_one_directory(tmp_path):
    # Another live process on this host holds the lock.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = {"host": os.uname().nodename, "pid": other.pid, "token": "x", "heartbeat": 0}
        (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
        with pytest.raises(RuntimeError, match=rf"Another training run.*process {other.pid}"):
            _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())
        assert json.loads((tmp_path / LOCK_NAME).read_text()) == holder  # Not overwritten.
    finally:
        other.kill()
        other.wait()
    # Once it is gone, its lock is stale: taken over with a warning.
    with pytest.warns(UserWarning, match="stale lock"):
        _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())


def test_two_callbacks_of_one_process_on_one_directory(tmp_path):
    first = BackupAndRestore(str(tmp_path))
    _start(first, _compiled_and_built())
    with pytest.raises(RuntimeError, match="Another training run"):
        _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())
    first.on_train_end()
    _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())  # Free again.


def test_lock_of_another_host_is_stale_after_the_timeout(tmp_path):
    holder = {"host": "elsewhere", "pid": 1, "token": "x", "heartbeat": 0}
    (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
    with pytest.raises(RuntimeError, match="host 'elsewhere'"):
        _start(BackupAndRestore(str(tmp_path), lock_timeout=None), _compiled_and_built())
    with pytest.warns(UserWarning, match="stale lock"):
        _start(BackupAndRestore(str(tmp_path), lock_timeout=60), _compiled_and_built())


def test_non_chief_processes_write_nothing(tmp_path, monkeypatch):
    """A whole fit as process 1 of 2: every callback restores/records, none writes."""
    from keras_accel.callbacks import ModelCheckpoint

    monkeypatch.setattr(process, "process_index", lambda: 1)
    backup_dir = tmp_path / "backup"
    callbacks = [
        BackupAndRestore(str(backup_dir), save_freq=1, delete_checkpoint=False),
        History(path=str(tmp_path / "history.json")),
        ModelCheckpoint(str(tmp_path / "m.keras"), monitor="loss"),
    ]
    x, y = data(40)
    history = compiled_mlp().fit(x, y, epochs=2, verbose=0, callbacks=callbacks)
    assert history.epoch == [0, 1]
    assert os.listdir(tmp_path) == []


def test_arguments_are_checked():
    # Keras's wording first, as Keras's own tests match it; then what was received.
    for empty in ("", None):
        with pytest.raises(
            ValueError,
            match=rf"^Empty `backup_dir` argument passed\. "
            rf"Received: backup_dir={empty!r}",
        ):
            BackupAndRestore(empty)
    with pytest.raises(ValueError, match=r"must be a path or URL string.*backup_dir=3 of type int"):
        BackupAndRestore(3)
    for save_freq in ("batch", 0, -1, 1.5, True):
        with pytest.raises(
            ValueError,
            match=rf"^Invalid value for argument `save_freq`\. "
            rf"Received: save_freq={re.escape(repr(save_freq))}\.",
        ):
            BackupAndRestore("x", save_freq=save_freq)
    with pytest.raises(ValueError, match="max_to_keep"):
        BackupAndRestore("x", max_to_keep=0)
    with pytest.raises(ValueError, match="lock_timeout"):
        BackupAndRestore("x", lock_timeout=0)
    assert BackupAndRestore("x", double_checkpoint=True, max_to_keep=1).max_to_keep == 2


def test_an_unbuilt_model_is_keras_error(tmp_path):
    model = keras.Sequential([keras.layers.Dense(1)])  # No Input: no variables yet.
    model.compile("sgd", "mse")
    with pytest.raises(
        ValueError,
        match=r"^To use the BackupAndRestore callback, you model "
        r"must be built before you call `fit\(\)`",
    ):
        _start(BackupAndRestore(str(tmp_path / "b")), model)
    assert not (tmp_path / "b").exists()  # Nothing created, nothing locked.


def test_keras_attribute_names(tmp_path):
    """Keras's `_current_epoch`, `_last_batch_seen` and backup paths, read by code (and by
    Keras's tests) written for Keras's callback."""
    backup = BackupAndRestore(str(tmp_path), save_freq=2, delete_checkpoint=False)
    _start(backup, _compiled_and_built(), steps=3)
    assert backup._weights_path is None and backup._prev_weights_path is None
    for epoch in range(2):
        backup.on_epoch_begin(epoch)
        assert (backup._current_epoch, backup._last_batch_seen) == (epoch, 0)
        for batch in range(3):
            backup.on_train_batch_end(batch)
            assert backup._last_batch_seen == batch
        backup.on_epoch_end(epoch)
        assert (backup._current_epoch, backup._last_batch_seen) == (epoch + 1, 0)
    # Every 2 batches, counted across epochs: after batch 2, after batch 4 (1 into the
    # second epoch), and after batch 6, the end of the second epoch (saved as epoch 3's start).
    assert [os.path.basename(p) for p in backup.checkpoints()] == [
        "ckpt-e000000-b00000002",
        "ckpt-e000001-b00000001",
        "ckpt-e000002-b00000000",
    ]
    newest, previous = backup.checkpoints()[2], backup.checkpoints()[1]
    assert backup._weights_path == os.path.join(newest, "variables.npz")
    assert backup._training_metadata_path == os.path.join(newest, "state.json")
    assert backup._prev_weights_path == os.path.join(previous, "variables.npz")
    assert backup._prev_training_metadata_path == os.path.join(previous, "state.json")
    metadata = json.loads(pathlib.Path(backup._prev_training_metadata_path).read_text())
    assert (metadata["epoch"], metadata["batch"]) == (1, 1)
    backup.on_train_end()


# ---------------------------------------------------------------------------------------
# A backup_dir written by keras.callbacks.BackupAndRestore.

KERAS_FILES = [
    "latest.weights.h5",
    "latest.weights.h5.bkp",
    "training_metadata.json",
    "training_metadata.json.bkp",
]


class _Record(keras.callbacks.Callback):
    """Weights and optimizer step at the start of training and at every epoch end, and what
    backup_dir holds then."""

    def __init__(self, folder=None):
        super().__init__()
        self.folder, self.at_end, self.listed = folder, {}, {}

    def on_train_begin(self, logs=None):
        self.at_start = (weights_of(self.model), int(self.model.optimizer.iterations.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        self.at_end[epoch] = weights_of(self.model)
        if self.folder is not None:
            self.listed[epoch] = sorted(os.listdir(self.folder))


def _interrupted_keras_run(folder):
    """Keras's own callback, interrupted at the start of epoch 3: its files are in folder."""
    model = compiled_mlp()
    record = _Record()
    callbacks = [
        keras.callbacks.BackupAndRestore(folder, double_checkpoint=True),
        record,
        Interrupt(2),
    ]
    with pytest.raises(KeyboardInterrupt):
        model.fit(*data(24), batch_size=8, epochs=4, verbose=0, callbacks=callbacks)
    assert sorted(os.listdir(folder)) == KERAS_FILES
    return record


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(u, v) for u, v in zip(a, b))


def test_resumes_from_a_keras_backup(tmp_path):
    folder = str(tmp_path / "backup")
    keras_run = _interrupted_keras_run(folder)
    model = compiled_mlp(seed=7)  # A new process: other initial weights.
    record, history = _Record(folder), History()
    with pytest.warns(
        UserWarning,
        match=r"resuming from a backup written by keras\.callbacks"
        r"\.BackupAndRestore .*latest\.weights\.h5.*starting at epoch 3",
    ):
        model.fit(
            *data(24),
            batch_size=8,
            epochs=4,
            verbose=0,
            callbacks=[BackupAndRestore(folder), record, history],
        )
    # Keras's weights and optimizer state after epoch 2 (3 steps an epoch), then epochs 3-4.
    assert _same(record.at_start[0], keras_run.at_end[1]) and record.at_start[1] == 6
    assert history.epoch == [2, 3] and int(model.optimizer.iterations.numpy()) == 12
    # The first backup in keras_accel's layout replaced Keras's files; the end removed all.
    assert record.listed[2] == [LOCK_NAME, "ckpt-e000003-b00000000"]
    assert not os.path.exists(folder)


def test_a_damaged_keras_backup_falls_back_to_its_previous_copy(tmp_path):
    folder = str(tmp_path / "backup")
    keras_run = _interrupted_keras_run(folder)
    with open(os.path.join(folder, "latest.weights.h5"), "wb") as f:
        f.write(b"0")  # As Keras's own test damages it.
    model = _compiled_and_built(seed=7)
    with pytest.warns(UserWarning, match="starting at epoch 2"):
        _start(BackupAndRestore(folder), model)
    assert _same(weights_of(model), keras_run.at_end[0]) and model._initial_epoch == 1


def test_unloadable_keras_backup_names_the_files_and_keeps_them(tmp_path):
    (tmp_path / "latest.weights.h5").write_bytes(b"not hdf5")
    (tmp_path / "training_metadata.json").write_text('{"epoch": 3, "batch": 0}')
    with pytest.raises(
        RuntimeError,
        match=r"keras\.callbacks\.BackupAndRestore "
        r"\(latest\.weights\.h5, training_metadata\.json\), but it cannot be "
        r"loaded.*latest\.weights\.h5: OSError",
    ):
        _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())
    assert sorted(os.listdir(tmp_path)) == ["latest.weights.h5", "training_metadata.json"]


def test_keras_and_keras_accel_backups_in_one_directory_is_an_error(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, _compiled_and_built())
    backup.save(1, 0)
    backup.on_train_end()
    (tmp_path / "training_metadata.json").write_text('{"epoch": 3, "batch": 0}')
    with pytest.raises(
        RuntimeError,
        match=r"\(training_metadata\.json\) and backups written by "
        r"keras_accel \(ckpt-e000001-b00000000\).*Move away the one",
    ):
        _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())
    assert not (tmp_path / LOCK_NAME).exists()


def test_verbose_prints_saves_and_restores(tmp_path, capsys):
    backup = BackupAndRestore(str(tmp_path), verbose=1, delete_checkpoint=False)
    _start(backup, _compiled_and_built())
    path = backup.save(1, 0)
    backup.on_train_end()
    restored = BackupAndRestore(str(tmp_path), verbose=1)
    _start(restored, _compiled_and_built())
    restored.on_train_end()
    assert capsys.readouterr().out == (
        f"\nBackupAndRestore: saved {path}\nBackupAndRestore: restored {path} (epoch 2, batch 0)\n"
    )
