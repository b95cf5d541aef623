"""keras_accel's callbacks on KERAS_BACKEND=torch: BackupAndRestore on
torch.distributed.checkpoint resumes a fit stopped mid-epoch exactly (plain `model.fit` and
`Accelerator.fit`, one process), and History, ModelCheckpoint and LearningRateScheduler
do what they do on JAX and TensorFlow. Each is compared with a plain uninterrupted Keras
run in the same process.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_accel.callbacks import (
    BackupAndRestore,
    History,
    LearningRateScheduler,
    ModelCheckpoint,
    Preempted,
)
from tests.helpers import compiled_mlp, data, weights_of

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="KERAS_BACKEND=torch"),
]

EPOCHS, BATCH, ROWS = 3, 16, 90  # 6 batches an epoch, the last one of 10 rows.
STOP = (1, 3)  # The fit is stopped at the end of batch 3 of epoch 1 (0-based).


class StopAt(keras.callbacks.Callback):
    """Raises at the end of batch `batch` of epoch `epoch`, after the callbacks before it
    (BackupAndRestore's backup of that batch among them) ran."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("stopped")


def _model():
    """The same model as in a new process: unseeded Dropout draws from torch's global
    generator, which the backup carries."""
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    return compiled_mlp(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), dropout=True)


def _fit(fit, model, callbacks):
    x, y = data(ROWS)
    return fit(
        model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks
    )


def _plain(model, *args, **kwargs):
    return model.fit(*args, **kwargs)


def _accelerated(model, *args, **kwargs):
    from keras_accel import Accelerator

    return Accelerator(seed=0).fit(model, *args, **kwargs)


@pytest.mark.parametrize("fit", [_plain, _accelerated], ids=["model.fit", "Accelerator.fit"])
def test_a_fit_stopped_mid_epoch_resumes_exactly(tmp_path, fit):
    backup_dir = str(tmp_path / "backup")
    straight = _model()
    expected = History()
    _fit(fit, straight, [expected])

    model = _model()
    log = str(tmp_path / "history.json")
    callbacks = [BackupAndRestore(backup_dir, save_freq=2), History(path=log), StopAt(*STOP)]
    with pytest.raises(RuntimeError, match="stopped"):
        _fit(fit, model, callbacks)
    listed = sorted(os.listdir(backup_dir))
    assert "dcp-8" in listed, listed  # 2 batches into epoch 1: the last backup before.

    model = _model()
    model.layers[0].kernel.assign(np.zeros(model.layers[0].kernel.shape))  # The backup wins.
    history = History(path=log)
    result = _fit(fit, model, [BackupAndRestore(backup_dir, save_freq=2), history])
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 6
    for a, b in zip(weights_of(model), weights_of(straight), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert history.epoch == expected.epoch == [0, 1, 2]
    assert result is history
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], expected.history[key], atol=1e-6)
    rows = json.loads(pathlib.Path(log).read_text())["epochs"]
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    assert not os.path.exists(backup_dir)  # Deleted once training completed.


def test_history_model_checkpoint_and_learning_rate_scheduler(tmp_path):
    """The three together in one plain fit: the schedule is applied per epoch (the optimizer
    reads it), History writes its rows and ModelCheckpoint its files and rotation; the
    weights equal a plain Keras fit with Keras's own LearningRateScheduler."""

    def schedule(epoch, rate):
        return 0.1 / (epoch + 1)

    x, y = data(ROWS)
    reference = _model()
    keras_history = reference.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        # Validation draws from torch's global generator (that unseeded Dropout reads) in
        # plain Keras too: the same validation in both runs.
        validation_data=data(30, seed=1),
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )

    model = _model()
    log = tmp_path / "history.json"
    history = History(path=str(log), csv=True)
    result = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        validation_data=data(30, seed=1),
        callbacks=[
            LearningRateScheduler(schedule),
            history,
            ModelCheckpoint(
                str(tmp_path / "e{epoch}.weights.h5"), save_weights_only=True, max_to_keep=2
            ),
            ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_loss", save_best_only=True),
        ],
    )
    assert result is history
    for a, b in zip(weights_of(model), weights_of(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], keras_history.history["loss"], atol=1e-6)
    np.testing.assert_allclose(history.history["learning_rate"], [0.1, 0.05, 0.1 / 3], rtol=1e-6)
    rows = json.loads(log.read_text())["epochs"]
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    assert (tmp_path / "history.csv").exists()
    assert sorted(p.name for p in tmp_path.glob("e*.weights.h5")) == [
        "e2.weights.h5",
        "e3.weights.h5",
    ]
    loaded = _model()
    loaded.load_weights(str(tmp_path / "e3.weights.h5"))
    for a, b in zip(weights_of(loaded), weights_of(model), strict=True):
        np.testing.assert_array_equal(a, b)
    best = keras.saving.load_model(str(tmp_path / "best.keras"))
    assert [w.shape for w in best.get_weights()] == [w.shape for w in model.get_weights()]


def test_a_damaged_latest_backup_is_skipped_for_the_one_before(tmp_path):
    """DCP itself would read the damaged file without a word: the checksums recorded at its
    commit catch it, and the callback sets it aside with a warning naming it."""
    model = _model()
    model.optimizer.build(model.trainable_variables)
    backup = BackupAndRestore(str(tmp_path), delete_checkpoint=False, save_on_background=False)
    backup.set_model(model)
    backup.set_params({"epochs": 5, "steps": 3, "verbose": 0})
    backup.on_train_begin()
    backup.save(1, 0)
    good = weights_of(model)
    model.layers[0].kernel.assign(model.layers[0].kernel.numpy() + 1.0)
    backup.save(2, 0)
    backup.on_train_end()
    arrays = backup._backups.open().files(6)[0]
    with open(arrays, "r+b") as f:
        f.truncate(os.path.getsize(arrays) // 3)

    other = _model()
    other.optimizer.build(other.trainable_variables)
    restored = BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    restored.set_model(other)
    restored.set_params({"epochs": 5, "steps": 3, "verbose": 0})
    size = os.path.getsize(arrays)
    with pytest.warns(
        UserWarning,
        match=rf"the backup of step 6 in '{tmp_path}' is damaged: __0_0\.distcp: {size} bytes "
        r"where its commit recorded \d+\. It is kept as .*/damaged/dcp-6-",
    ):
        restored.on_train_begin()
    for a, b in zip(weights_of(other), good, strict=True):
        np.testing.assert_array_equal(a, b)
    assert other._initial_epoch == 1
    restored.on_train_end()


@pytest.mark.parametrize(
    "other, named",
    [("7", "Orbax checkpoints"), ("checkpoint", "tf.train checkpoints")],
    ids=["orbax", "tf.train"],
)
def test_another_backends_backups_are_refused_and_left_alone(tmp_path, other, named):
    if other.isdigit():
        (tmp_path / other).mkdir()  # Orbax's step directory.
    else:
        (tmp_path / other).write_text("x")  # tf.train's state file.
    model = _model()
    backup = BackupAndRestore(str(tmp_path))
    backup.set_model(model)
    backup.set_params({"epochs": 1, "steps": 3, "verbose": 0})
    with pytest.raises(RuntimeError, match=f"holds {named} .* KERAS_BACKEND=torch cannot"):
        backup.on_train_begin()
    assert other in os.listdir(tmp_path)


# ---------------------------------------------------------------------- 2 real processes
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _preempted_process(rank: int, port: int, backup_dir: str) -> None:
    """One of 2 gloo processes, each training the same plain `model.fit`; only process 1
    is sent SIGTERM (after its batch 2). Both must save one backup at the same step and
    stop with exit code 143."""
    import datetime

    import torch.distributed as dist

    from keras_accel.state.engines import torch_dcp

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    torch_dcp.TIMEOUT_S = 30.0  # A process saving alone fails soon instead of hanging.

    class TermAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and batch == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    model = _model()
    try:
        _fit(_plain, model, [TermAt(), BackupAndRestore(backup_dir, save_freq=False)])
    except Preempted:
        print(f"preempted after {int(model.optimizer.iterations.numpy())} steps", flush=True)
        raise


def test_sigterm_to_one_of_two_processes_stops_both_at_one_backup(tmp_path):
    """The preemption flag is agreed over the process group at every batch end: a SIGTERM
    that reaches one process only still makes every process save the same step (the save
    is collective), then stop with 143."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backup_dir = tmp_path / "backup"
    env = dict(os.environ, KERAS_BACKEND="torch", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "preempted", str(rank), str(port), str(backup_dir)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    for rank, (p, output) in enumerate(zip(processes, outputs)):
        assert p.returncode == 143, f"process {rank} ({p.returncode}):\n{output[-3000:]}"
        assert "preempted after 3 steps" in output, output[-3000:]
    assert "SIGTERM (preemption) reached every process" in outputs[0]
    assert sorted(os.listdir(backup_dir / "dcp-3")) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "keras_accel.checksums.json",
        "meta.json",
    ]


if __name__ == "__main__" and sys.argv[1:2] == ["preempted"]:
    _preempted_process(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
