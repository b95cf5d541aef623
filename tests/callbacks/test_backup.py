"""BackupAndRestore: what is saved, how it is found again, and every way it can go wrong."""

import errno
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

from keras_accel.callbacks import BackupAndRestore, History, Preempted
from keras_accel.callbacks._lock import LOCK_NAME
from keras_accel.utils import process
from tests.helpers import FEW_REPLICAS, Interrupt, compiled_mlp, data, weights_of

pytestmark = pytest.mark.torch  # Also on KERAS_BACKEND=torch (torch.distributed.checkpoint).


def test_interrupted_fit_resumes_where_it_stopped(tmp_path):
    """Keras's own example: the second fit runs only the missing epochs and the History
    record continues, with every epoch once."""
    backup_dir = str(tmp_path / "backup")
    x, y = data(40)
    model = _fresh()
    history = History(path=str(tmp_path / "history.json"))
    backup = BackupAndRestore(backup_dir)
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, history, Interrupt(2)])
    backup.wait()  # Keras skips on_train_end on an exception: the saves finish anyway.
    assert [int(_step(p)) for p in backup.checkpoints()] == [2, 4]  # 2 steps an epoch

    # A new process: fresh objects, same model definition.
    model = _fresh(seed=7)  # Different initial weights: the backup must win.
    history = History(path=str(tmp_path / "history.json"))
    with warnings.catch_warnings():
        # Same process, same callback object: its own lock is no "stale lock".
        warnings.simplefilter("error", UserWarning)
        result = model.fit(x, y, epochs=4, verbose=0, callbacks=[history, backup], initial_epoch=0)
    assert result is history
    assert history.epoch == [0, 1, 2, 3]
    assert len(history.history["loss"]) == 4
    # 2 steps per epoch: 4 restored with the optimizer, 4 trained now, none doubled.
    assert model.optimizer.iterations.numpy() == 4 * 2
    assert not os.path.exists(backup_dir), os.listdir(backup_dir)  # delete_checkpoint: all gone
    assert model._initial_epoch is None  # A later fit starts where it is told to.


class Terminate(keras.callbacks.Callback):
    """Sends this process a SIGTERM at the end of training batch `at` (counted over the
    fit), as a cloud does before it takes the machine."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_saves_a_backup_exits_143_and_the_next_fit_resumes_exactly(tmp_path):
    backup_dir = str(tmp_path / "backup")
    x, y = data(60)  # 2 batches of 32 an epoch
    before = signal.getsignal(signal.SIGTERM)
    model = _fresh()
    backup = BackupAndRestore(backup_dir, save_freq=False)  # Saves only when preempted.
    with pytest.raises(Preempted, match="SIGTERM .* saved .* resumes from it") as stopped:
        model.fit(x, y, epochs=3, verbose=0, shuffle=False, callbacks=[Terminate(3), backup])
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before  # Python's handler is back.
    assert [int(_step(p)) for p in backup.checkpoints()] == [3]  # Where it stopped.
    assert model.optimizer.iterations.numpy() == 3

    resumed = _fresh(seed=7)
    # shuffle=False: a plain model.fit draws each epoch's order from the global RNG at the
    # epoch's start, which a mid-epoch backup cannot give back (Accelerator.fit can).
    resumed.fit(x, y, epochs=3, verbose=0, shuffle=False, callbacks=[BackupAndRestore(backup_dir)])
    straight = _fresh()
    straight.fit(x, y, epochs=3, verbose=0, shuffle=False)
    assert resumed.optimizer.iterations.numpy() == 6
    for a, b in zip(weights_of(resumed), weights_of(straight), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_fit_that_raises_leaves_no_sigterm_handler_that_swallows_the_signal(tmp_path):
    """Keras skips `on_train_end` when fit raises, so nothing closes the watch: a SIGTERM
    after that fit reaches the handler that was there before (here a recorder; Python's
    default would end the process), and that handler is installed again."""
    received = []

    def recorder(signum, frame):
        received.append(signum)

    before = signal.signal(signal.SIGTERM, recorder)
    try:
        x, y = data(40)
        model = _fresh()
        with pytest.raises(KeyboardInterrupt):
            model.fit(
                x,
                y,
                epochs=3,
                verbose=0,
                callbacks=[BackupAndRestore(str(tmp_path / "backup")), Interrupt(1)],
            )
        assert signal.getsignal(signal.SIGTERM) is not recorder  # Ours, left by the fit.
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is recorder
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_resumed_fit_that_raises_leaves_no_epoch_to_start_at(tmp_path):
    """The epoch a restore gives Keras is cleared once Keras has read it, not only at
    `on_train_end`, which a fit that raises never reaches: the next fit starts where it is
    told to."""
    backup_dir = str(tmp_path / "backup")
    x, y = data(40)
    model = _fresh()
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=4, verbose=0, callbacks=[BackupAndRestore(backup_dir), Interrupt(2)])
    with pytest.raises(KeyboardInterrupt):  # Resumes at epoch 2, then raises in epoch 3.
        model.fit(x, y, epochs=4, verbose=0, callbacks=[BackupAndRestore(backup_dir), Interrupt(3)])
    assert model._initial_epoch is None
    epochs = History()
    model.fit(x, y, epochs=2, verbose=0, callbacks=[epochs])
    assert epochs.epoch == [0, 1]


def _step(path):
    """The step number of a checkpoint path (Orbax: `<dir>/<step>`; tf.train: `ckpt-<step>`;
    torch's DCP: `dcp-<step>`)."""
    return os.path.basename(path).removeprefix("ckpt-").removeprefix("dcp-")


def _fresh(**kwargs):
    """A compiled model with a built optimizer, named as in a new process: Keras numbers the
    layers of every model built in one session on (dense, dense_1, ...)."""
    keras.backend.clear_session(free_memory=False)
    return _compiled_and_built(**kwargs)


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
    model = _fresh()
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

    other = _fresh(seed=9)
    restored = BackupAndRestore(str(tmp_path))
    _start(restored, other)
    assert [np.array_equal(a, b) for a, b in zip(weights_of(other), expected)] == [True] * len(
        expected
    )
    assert int(other.optimizer.iterations.numpy()) == 7
    assert other._initial_epoch == 2
    assert (random.random(), np.random.rand()) == expected_draws
    restored.on_train_end()


def _damage(path):
    """Overwrite the middle of the largest file under `path` (a checkpoint's arrays)."""
    candidates = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    )
    target = max(candidates, key=os.path.getsize)
    size = os.path.getsize(target)
    with open(target, "r+b") as f:
        f.truncate(max(size // 3, 1))
    return target


def test_damaged_latest_falls_back_to_the_previous_with_a_warning(tmp_path):
    """The newest backup, its largest file cut short: caught by the checksums its commit
    recorded (tf.train: by its own), named with its step, file and what differs, set aside
    under damaged/ (kept, never listed again) and the one before it restored."""
    model = _fresh()
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    _start(backup, model)
    backup.save(1, 0)
    good = weights_of(model)
    _shift(model, 1.0)
    damaged = backup.save(2, 0)
    backup.on_train_end()
    target = _damage(backup._backups.open().files(int(_step(damaged)))[0])
    size = os.path.getsize(target)

    other = _fresh(seed=4)
    restored = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    with pytest.warns(UserWarning) as caught:
        _start(restored, other)
    (warning,) = [str(w.message) for w in caught if "damaged" in str(w.message)]
    aside = re.search(r"It is kept as '([^']*)'", warning).group(1)
    assert warning.startswith(
        f"BackupAndRestore: the backup of step 6 in {str(tmp_path)!r} is damaged: "
    )
    assert warning.endswith(
        f"It is kept as {aside!r}, never resumed from or counted as the latest again. "
        "Resuming from step 3, the newest intact backup."
    )
    if keras.backend.backend() == "tensorflow":  # Its own checksums, its own words.
        assert f"{os.path.basename(target)}: shorter than its index says" in warning
    else:
        name = os.path.relpath(target, damaged).replace(os.sep, "/")
        assert f"{name}: {size} bytes where its commit recorded " in warning
    assert os.path.dirname(aside) == str(tmp_path / "damaged") and os.listdir(aside)
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(other), good))
    assert other._initial_epoch == 1
    assert [int(_step(p)) for p in restored.checkpoints()] == [3]
    # The next save at the damaged one's position is a new backup; the damaged one stays.
    restored.save(2, 0)
    restored.wait()
    assert [int(_step(p)) for p in restored.checkpoints()] == [3, 6]
    restored.on_train_end()
    third = _fresh(seed=5)
    final = BackupAndRestore(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _start(final, third)
    assert third._initial_epoch == 2
    final.on_train_end()
    assert os.listdir(tmp_path) == ["damaged"]  # delete_checkpoint: the rest is gone.


def _interrupted_save(folder, step):
    """What a process killed while its engine wrote backup `step` leaves: Orbax's temporary
    step directory, tf.train's `ckpt-<step>_temp`, or DCP's `dcp-<step>` without `.metadata`."""
    name = {
        "jax": f"{step}.orbax-checkpoint-tmp",
        "tensorflow": f"ckpt-{step}_temp",
        "torch": f"dcp-{step}",
    }[keras.backend.backend()]
    (folder / name).mkdir()
    (folder / name / "partial").write_bytes(b"half written")


def test_an_interrupted_save_is_named_when_the_next_run_starts(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    model = _fresh()
    _start(backup, model)
    backup.save(1, 0)  # Step 3 (3 steps an epoch): complete.
    backup.on_train_end()
    saved = weights_of(model)
    _interrupted_save(tmp_path, 6)
    resumed = _fresh(seed=7)
    with pytest.warns(
        UserWarning,
        match=r"the backup of step 6 .* never committed it; its partial files are removed\. "
        r"Resuming from the complete backups \(steps \[3\]\)",
    ):
        _start(BackupAndRestore(str(tmp_path)), resumed)
    assert _same(weights_of(resumed), saved) and resumed._initial_epoch == 1
    assert not [name for name in os.listdir(tmp_path) if "tmp" in name or "temp" in name]


def test_an_interrupted_first_save_is_no_silent_fresh_start(tmp_path):
    _interrupted_save(tmp_path, 3)
    model = _fresh()
    initial = weights_of(model)
    with pytest.warns(UserWarning, match=r"step 3 .* no complete backup: training starts from"):
        _start(BackupAndRestore(str(tmp_path)), model)
    assert _same(weights_of(model), initial) and not model._initial_epoch
    assert not [name for name in os.listdir(tmp_path) if "tmp" in name or "temp" in name]


def test_nothing_usable_is_an_error_and_nothing_is_deleted(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    _start(backup, _fresh())
    path = backup.save(1, 0)
    backup.on_train_end()
    arrays, record = backup._backups.open().files(int(_step(path)))
    target = _damage(arrays)
    before = sorted(os.listdir(tmp_path))
    restored = BackupAndRestore(str(tmp_path))
    with pytest.raises(RuntimeError) as error:
        _start(restored, _fresh())
    assert str(error.value).startswith(
        f"BackupAndRestore: no backup in {str(tmp_path)!r} is intact: step 3 ({path}): "
        f"{os.path.basename(target) if keras.backend.backend() == 'tensorflow' else ''}"
    )
    assert str(error.value).endswith(
        "They were left as they are: move them away to start training from scratch, or "
        "restore a copy of the directory."
    )
    assert sorted(os.listdir(tmp_path)) == before  # Nothing deleted, no lock left.
    assert LOCK_NAME not in before


def test_a_different_model_names_the_variables_and_changes_nothing(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    _start(backup, _fresh())
    path = backup.save(1, 0)
    backup.on_train_end()
    before = {p: (pathlib.Path(p).read_bytes() if os.path.isfile(p) else None)
              for p in map(str, pathlib.Path(tmp_path).rglob("*"))}  # fmt: skip

    keras.backend.clear_session(free_memory=False)
    wider = keras.Sequential(  # compiled_mlp's layers, the first 32 units wide, not 16.
        [
            keras.Input((6,)),
            keras.layers.Dense(32),
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
    assert "'model/sequential/dense/kernel' (6, 16) saved, (6, 32) here" in message
    assert "partial_restore=True" in message
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(wider), initial))
    after = {p: (pathlib.Path(p).read_bytes() if os.path.isfile(p) else None)
             for p in map(str, pathlib.Path(tmp_path).rglob("*"))}  # fmt: skip
    assert after == before  # Nothing changed, and the lock released: fix and rerun.

    keras.backend.clear_session(free_memory=False)
    shallower = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, name="only")])
    shallower.compile("sgd", "mse")
    with pytest.raises(ValueError) as error:
        _start(BackupAndRestore(str(tmp_path)), shallower)
    message = str(error.value)
    assert "not in the checkpoint: 'model/sequential/only/kernel'" in message
    assert "in the checkpoint but not in this model: 'model/sequential/dense/kernel'" in message
    del path


def test_partial_restore_takes_what_matches_and_names_the_rest(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    model = _fresh()
    _start(backup, model)
    backup.save(1, 0)
    saved = {v.path: np.asarray(v.numpy()) for v in model.variables}
    backup.on_train_end()
    keras.backend.clear_session(free_memory=False)
    grown = keras.Sequential(  # Same first layers, another head.
        [
            keras.Input((6,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(5),
        ]
    )
    grown.compile("sgd", "sparse_categorical_crossentropy")
    grown.optimizer.build(grown.trainable_variables)
    head = np.asarray(grown.layers[-1].kernel.numpy())
    with pytest.warns(UserWarning, match=r"partial restore .*sequential/dense_1/kernel"):
        _start(BackupAndRestore(str(tmp_path), partial_restore=True), grown)
    first = grown.layers[0]
    np.testing.assert_array_equal(first.kernel.numpy(), saved[first.kernel.path])
    np.testing.assert_array_equal(grown.layers[-1].kernel.numpy(), head)  # Reshaped: kept.


def test_a_model_built_again_in_one_session_restores_and_a_wider_one_is_refused(tmp_path):
    """A notebook's next cell builds the same model again without clear_session: Keras
    names it `sequential_1/dense_2/...`, `adam_1/...`; the backup (`sequential/dense/...`)
    still restores, variable for variable, as Keras's own BackupAndRestore would. A model of
    other widths is still refused, by name."""
    model = _fresh()
    _shift(model, 0.25)
    saved = [np.asarray(v.numpy()) for v in [*model.variables, *model.optimizer.variables]]
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    _start(backup, model)
    backup.save(1, 0)
    backup.on_train_end()
    again = _compiled_and_built()  # No clear_session: Keras numbers its layers on.
    assert again.layers[0].kernel.path != model.layers[0].kernel.path
    _start(BackupAndRestore(str(tmp_path), delete_checkpoint=False), again)
    restored = [np.asarray(v.numpy()) for v in [*again.variables, *again.optimizer.variables]]
    for want, got in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(got, want)
    wider = _compiled_and_built(classes=4)
    with pytest.raises(ValueError, match=r"of another shape: 'model/sequential/dense_1/kernel'"):
        _start(BackupAndRestore(str(tmp_path)), wider)


def test_rotation_keeps_max_to_keep(tmp_path):
    backup = BackupAndRestore(str(tmp_path), max_to_keep=2, delete_checkpoint=False)
    _start(backup, _fresh())
    for epoch in range(1, 5):
        backup.save(epoch, 0)
    backup.wait()
    assert [int(_step(p)) for p in backup.checkpoints()] == [9, 12]
    backup.on_train_end()


def test_saving_in_the_background_and_waiting(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)  # save_on_background
    _start(backup, _fresh())
    path = backup.save(1, 0)
    backup.wait()  # On disk after wait(), whatever the engine's timing.
    assert backup.checkpoints() == [path]
    blocking = BackupAndRestore(str(tmp_path / "b"), save_on_background=False)
    _start(blocking, _fresh())
    path = blocking.save(1, 0)
    assert blocking.checkpoints() == [path]  # On disk when save() returns.
    blocking.on_train_end()
    backup.on_train_end()


def test_a_failing_save_is_a_clear_error_and_the_previous_backups_survive(tmp_path, monkeypatch):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    model = _fresh()
    _start(backup, model)
    first = backup.save(1, 0)
    engine = backup._backups.open()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine, "save", full_disk)
    with pytest.raises(OSError) as error:
        backup.save(2, 0)
    assert str(error.value) == (
        f"BackupAndRestore: could not write the backup of step 6 to {str(tmp_path)!r}: no "
        "space left on the device (OSError: [Errno 28] No space left on device). Nothing of "
        "it is left that a later run could take for a backup. The newest intact backup is "
        f"step 3 ({first}): run the same fit again, once there is space again, to resume "
        "from it."
    )
    assert error.value.errno == errno.ENOSPC
    monkeypatch.undo()
    backup.on_train_end()
    restored = BackupAndRestore(str(tmp_path))
    _start(restored, _fresh(seed=3))
    assert restored.checkpoints() == [first] and restored.model._initial_epoch == 1
    restored.on_train_end()


def test_a_background_save_that_fails_is_reported_by_the_next_wait(tmp_path, monkeypatch):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, _fresh())
    backup.save(1, 0)
    engine = backup._backups.open()
    real_wait = engine.wait
    real_wait()

    def failed_in_the_background():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine, "wait", failed_in_the_background)
    with pytest.raises(OSError, match=r"could not write the backup of step 3 to .* no space "):
        backup.wait()
    monkeypatch.setattr(engine, "wait", real_wait)
    backup.on_train_end()
    assert [int(_step(p)) for p in backup.checkpoints()] == [3]


def test_mid_epoch_backup_needs_the_same_epoch_length(tmp_path):
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    _start(backup, _fresh(), steps=10)
    backup.save(1, 4)
    backup.on_train_end()
    with pytest.raises(ValueError, match=r"4 batches into epoch 2, with 10 batches.*has 7"):
        _start(BackupAndRestore(str(tmp_path)), _fresh(), steps=7)


def test_backup_dir_that_is_a_file(tmp_path):
    target = tmp_path / "not_a_dir"
    target.write_text("precious")
    with pytest.raises(NotADirectoryError, match="is a file"):
        _start(BackupAndRestore(str(target)), _compiled_and_built())
    with pytest.raises(NotADirectoryError, match="a part of it is a file"):
        _start(BackupAndRestore(str(target / "sub")), _compiled_and_built())
    assert target.read_text() == "precious"


def test_a_path_the_engine_cannot_write_is_refused_at_once():
    # Every engine writes the schemes fsspec has (Orbax and tf.train staged through the
    # local disk): a scheme nothing serves.
    url = "nosuchscheme://run"
    with pytest.raises(ValueError, match=rf"cannot write '{url}'.*Received: backup_dir"):
        BackupAndRestore(url)


def test_another_format_in_backup_dir_is_refused_with_what_it_is(tmp_path):
    old = tmp_path / "ckpt-e000001-b00000000"  # keras_accel 0.1's npz layout
    old.mkdir()
    (old / "variables.npz").write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"keras_accel 0\.1's npz backups"):
        _start(BackupAndRestore(str(tmp_path)), _fresh())


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


def test_non_chief_processes_write_only_their_share_of_the_state(tmp_path, monkeypatch):
    """A whole fit as process 1 of 2: every callback restores/records; the logs and files
    are the chief's, the backup's arrays go to the engine from every process (each writes
    what it holds, or, on TensorFlow, a scratch copy), but no lock and no deletion."""
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
    if keras.backend.backend() == "tensorflow":
        # tf.train: every worker saves (reading a variable synced on read is a collective),
        # the others into a scratch directory of their own, removed again.
        assert os.listdir(tmp_path) == []
        return
    assert os.listdir(tmp_path) == ["backup"]  # Orbax: every process writes its shards.
    assert LOCK_NAME not in os.listdir(backup_dir)


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
    backup.wait()
    assert [int(_step(p)) for p in backup.checkpoints()] == [2, 4, 6]
    engine = backup._backups.open()
    assert (backup._weights_path, backup._training_metadata_path) == engine.files(6)
    assert (backup._prev_weights_path, backup._prev_training_metadata_path) == engine.files(4)
    assert all(os.path.exists(p) for p in engine.files(4) + engine.files(6))
    assert (engine.read_meta(4)["epoch"], engine.read_meta(4)["batch"]) == (1, 1)
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
    # The first backup by the engine replaced Keras's files; the end removed all.
    assert not set(KERAS_FILES) & set(record.listed[2]) and LOCK_NAME in record.listed[2]
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
        r"keras_accel \(steps \[3\]\).*Move away the one",
    ):
        _start(BackupAndRestore(str(tmp_path)), _compiled_and_built())
    assert not (tmp_path / LOCK_NAME).exists()


def test_verbose_prints_saves_and_restores(tmp_path, capsys):
    backup = BackupAndRestore(str(tmp_path), verbose=1, delete_checkpoint=False)
    _start(backup, _fresh())
    path = backup.save(1, 0)
    backup.on_train_end()
    restored = BackupAndRestore(str(tmp_path), verbose=1)
    _start(restored, _fresh())
    restored.on_train_end()
    assert capsys.readouterr().out == (
        f"\nBackupAndRestore: saved {path}\nBackupAndRestore: restored {path} (epoch 2, batch 0)\n"
    )


# ---------------------------------------------------------------------------------------
# Keyed by path, whatever order the layers were created in.


class CrashAfter(keras.callbacks.Callback):
    """Raises at the end of epoch `epoch`, after BackupAndRestore handed its backup on, and
    keeps the state then, by variable path."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.saved = _by_path(self.model)
            raise RuntimeError("crash")


class _AtTrainBegin(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.state = _by_path(self.model)
        self.iterations = int(self.model.optimizer.iterations.numpy())


def _by_path(model):
    return {v.path: np.asarray(v.numpy()) for v in model.variables}


def _named(order, extra=False):
    """enc -> d1 -> head -> d2 (and an `extra` layer), named, created in `order`; the two
    Dropouts' seed states are what Keras numbers by creation order."""
    init = keras.initializers.GlorotUniform
    make = {
        "enc": lambda: keras.layers.Dense(16, name="enc", kernel_initializer=init(3)),
        "d1": lambda: keras.layers.Dropout(0.3, name="d1", seed=1),
        "head": lambda: keras.layers.Dense(3, name="head", kernel_initializer=init(4)),
        "d2": lambda: keras.layers.Dropout(0.6, name="d2", seed=2),
    }
    layers = {name: make[name]() for name in order}
    inputs = keras.Input((6,))
    hidden = layers["d1"](layers["enc"](inputs))
    if extra:
        hidden = keras.layers.Dense(16, name="extra")(hidden)
    outputs = keras.layers.Softmax()(layers["d2"](layers["head"](hidden)))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    return model


def _accelerated(order, **kwargs):
    from keras_accel import Accelerator

    keras.backend.clear_session(free_memory=False)  # As in a new process.
    # The subject is the state's paths, not the replica count: TensorFlow on 2 replicas.
    tensorflow = keras.backend.backend() == "tensorflow"
    acc = Accelerator(seed=0, devices=FEW_REPLICAS if tensorflow else None)
    with acc.scope():
        return acc, _named(order, **kwargs)


FIRST, OTHER = ["enc", "d1", "head", "d2"], ["d2", "head", "d1", "enc"]


def test_layers_created_in_another_order_resume_exactly_by_path(tmp_path):
    """Accelerator.fit ended by an exception after epoch 1; the next run creates the same
    named layers in the other order. It resumes at epoch 2 with the saved state, each layer
    its own (Keras numbers the Dropouts' seed generators by creation order: keyed by those
    numbers, their states changed places), and ends where the uninterrupted run ends."""
    x, y = data(64)
    acc, straight = _accelerated(FIRST)
    acc.fit(straight, x, y, batch_size=16, epochs=4, verbose=0)
    expected = _by_path(straight)

    acc, first = _accelerated(FIRST)
    backup, crash = BackupAndRestore(str(tmp_path / "backup")), CrashAfter(1)
    with pytest.raises(RuntimeError, match="crash"):
        acc.fit(first, x, y, batch_size=16, epochs=4, verbose=0, callbacks=[backup, crash])
    backup.wait()

    acc, other = _accelerated(OTHER)
    names = {v.path: v for v in other.variables}
    assert [v.path for v in other.get_layer("d1").variables] == [
        "seed_generator_1/seed_generator_state"
    ]  # The numbers changed hands.
    begin, history = _AtTrainBegin(), History()
    acc.fit(other, x, y, batch_size=16, epochs=4, verbose=0, callbacks=[backup, begin, history])
    assert history.epoch == [2, 3] and begin.iterations == 2 * 4
    for layer in ("enc", "head", "d1", "d2"):
        for v_saved, v_here in zip(
            first.get_layer(layer).variables, other.get_layer(layer).variables, strict=True
        ):
            np.testing.assert_array_equal(
                begin.state[v_here.path], crash.saved[v_saved.path], err_msg=layer
            )
    for path, value in expected.items():
        if path.startswith("seed_generator"):
            continue  # Compared by layer below.
        np.testing.assert_array_equal(np.asarray(names[path].numpy()), value, err_msg=path)
    for layer in ("d1", "d2"):
        np.testing.assert_array_equal(
            other.get_layer(layer).variables[0].numpy(),
            straight.get_layer(layer).variables[0].numpy(),
            err_msg=layer,
        )


def test_a_model_with_another_layer_is_refused_by_path_through_the_accelerator(tmp_path):
    x, y = data(64)
    acc, first = _accelerated(FIRST)
    backup, crash = BackupAndRestore(str(tmp_path / "backup")), CrashAfter(1)
    with pytest.raises(RuntimeError, match="crash"):
        acc.fit(first, x, y, batch_size=16, epochs=4, verbose=0, callbacks=[backup, crash])
    backup.wait()
    acc, grown = _accelerated(OTHER, extra=True)
    initial = _by_path(grown)
    with pytest.raises(ValueError) as error:
        acc.fit(grown, x, y, batch_size=16, epochs=4, verbose=0, callbacks=[backup])
    message = str(error.value)
    assert "not in the checkpoint: 'model/extra/kernel', 'model/extra/bias'" in message
    assert "'optimizer/adam/extra_kernel_momentum'" in message
    assert "'model/head/kernel' (16, 3) saved" not in message  # Same shape: only extra.
    assert all(np.array_equal(v, initial[k]) for k, v in _by_path(grown).items())


def test_backups_that_keyed_seed_states_by_keras_numbers_are_still_read(tmp_path, monkeypatch):
    """Backups written before seed states were keyed by layer name them
    `model/seed_generator_<n>/seed_generator_state`: read by that name when it is there."""
    from keras_accel.state import tree

    keras.backend.clear_session(free_memory=False)
    model = _named(FIRST)
    model.optimizer.build(model.trainable_variables)
    model.get_layer("d1").seed_generator.state.assign(np.array([11, 12], "uint32"))
    model.get_layer("d2").seed_generator.state.assign(np.array([21, 22], "uint32"))
    variables = tree.variables
    monkeypatch.setattr(tree, "variables", lambda m, legacy=True: variables(m, legacy=True))
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    _start(backup, model)
    backup.save(1, 0)
    backup.on_train_end()
    monkeypatch.setattr(tree, "variables", variables)
    manifest = backup._backups.open().read_meta(3)["manifest"]
    assert "model/seed_generator_1/seed_generator_state" in manifest
    keras.backend.clear_session(free_memory=False)
    same = _named(FIRST)
    _start(BackupAndRestore(str(tmp_path)), same)
    assert list(same.get_layer("d1").seed_generator.state.numpy()) == [11, 12]
    assert list(same.get_layer("d2").seed_generator.state.numpy()) == [21, 22]
