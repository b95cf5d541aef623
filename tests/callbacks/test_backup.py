"""BackupAndRestore: what is saved, how it is found again, and every way it can go wrong."""

import json
import os
import random
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
    with pytest.raises(ValueError, match="backup_dir"):
        BackupAndRestore("")
    for save_freq in ("batch", 0, -1, 1.5, True):
        with pytest.raises(ValueError, match="save_freq"):
            BackupAndRestore("x", save_freq=save_freq)
    with pytest.raises(ValueError, match="max_to_keep"):
        BackupAndRestore("x", max_to_keep=0)
    with pytest.raises(ValueError, match="lock_timeout"):
        BackupAndRestore("x", lock_timeout=0)
    assert BackupAndRestore("x", double_checkpoint=True, max_to_keep=1).max_to_keep == 2
