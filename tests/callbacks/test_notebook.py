"""A notebook's day: a fit stopped by Ctrl-C or by an error, the model built again in the same
Python session (Keras numbers its layers and optimizer on: `sequential_1/dense_2/kernel`,
`adam_1/...`), and the next fit resumes where the first left off, as it does with Keras's
own BackupAndRestore. Keras skips `on_train_end` when `fit` raises, so nothing of the
stopped fit may stay in the way: its lock, its SIGTERM handler, the epoch it set."""

import os
import signal
import threading
import warnings

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import BackupAndRestore
from keras_accel.callbacks._lock import LOCK_NAME
from tests.helpers import FEW_REPLICAS, compiled_mlp, data

EPOCHS, BATCH = 4, 16


class Stop(keras.callbacks.Callback):
    """Raises `error` as epoch `epoch` begins (after the backups of the epochs before it)."""

    def __init__(self, epoch, error):
        super().__init__()
        self.epoch, self.error = epoch, error

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise self.error("stopped")


def _reference(x, y):
    """The uninterrupted run: plain Keras on one device (the models' initializers are
    seeded, so every build starts from the same weights)."""
    model = compiled_mlp()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError], ids=["ctrl_c", "error"])
def test_accelerator_fit_stopped_then_a_rebuilt_model_resumes(tmp_path, error):
    x, y = data(40)  # 3 batches an epoch, the last one partial.
    expected = _reference(x, y)
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    directory = str(tmp_path / "backup")
    handler = signal.getsignal(signal.SIGTERM)
    with acc.scope():
        first = compiled_mlp()
    with pytest.raises(error, match="stopped"):
        acc.fit(
            first,
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[BackupAndRestore(directory), Stop(2, error)],
        )
    # The call let go on its way out: no lock, no SIGTERM handler; the backups stay.
    assert LOCK_NAME not in os.listdir(directory)
    assert signal.getsignal(signal.SIGTERM) is handler
    with acc.scope():
        again = compiled_mlp()  # No clear_session: other names than the backup's.
    assert again.layers[0].kernel.path != first.layers[0].kernel.path
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # No "stale lock" to take over.
        history = acc.fit(
            again,
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[BackupAndRestore(directory)],
        )
    assert history.epoch == [2, 3]
    for got, want in zip(again.get_weights(), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert not os.path.exists(directory)  # Ended normally: the backups are deleted.


def test_model_fit_stopped_by_ctrl_c_then_a_rebuilt_model_resumes(tmp_path):
    """Under a plain `model.fit` nothing tells the callback that the fit ended: the next fit
    on the directory finds the stopped fit on no thread's stack and takes over its lock, in
    silence (it is this process's own), and the first callback's SIGTERM handler goes."""
    x, y = data(40)
    expected = _reference(x, y)
    directory = str(tmp_path / "backup")
    handler = signal.getsignal(signal.SIGTERM)
    first = compiled_mlp()
    with pytest.raises(KeyboardInterrupt):
        first.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[BackupAndRestore(directory), Stop(2, KeyboardInterrupt)],
        )
    assert LOCK_NAME in os.listdir(directory)  # Keras skipped on_train_end.
    again = compiled_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        history = again.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[BackupAndRestore(directory)],
        )
    assert history.epoch == [2, 3]
    for got, want in zip(again.get_weights(), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not os.path.exists(directory)
    assert signal.getsignal(signal.SIGTERM) is handler


class _Hold(keras.callbacks.Callback):
    """Holds its fit in its first epoch until `release` is set."""

    def __init__(self):
        super().__init__()
        self.inside, self.release = threading.Event(), threading.Event()

    def on_epoch_begin(self, epoch, logs=None):
        self.inside.set()
        self.release.wait(120)


def test_a_fit_running_in_another_thread_keeps_its_directory(tmp_path):
    """The other side of the rule: a fit of this process that is still running (here in a
    thread) keeps its lock, and a second fit on the directory is refused."""
    x, y = data(40)
    directory = str(tmp_path / "backup")
    hold = _Hold()
    running = compiled_mlp()
    errors = []

    def train():
        try:
            running.fit(x, y, epochs=2, verbose=0, callbacks=[BackupAndRestore(directory), hold])
        except BaseException as e:  # Reported below, not lost in the thread.
            errors.append(e)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        assert hold.inside.wait(120)
        with pytest.raises(RuntimeError, match="Another training run is using the backup"):
            compiled_mlp().fit(x, y, epochs=1, verbose=0, callbacks=[BackupAndRestore(directory)])
    finally:
        hold.release.set()
        thread.join(120)
    assert not errors and not os.path.exists(directory)


class StopInside(keras.callbacks.Callback):
    """Ctrl-C at the end of batch `batch` of epoch `epoch`, taking groups of fused steps of
    any size (`fusion_period`), so that it stops a grouped fit between two groups."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch, self.seen = (epoch, batch), None, []

    def fusion_period(self, kind, steps):
        return None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((self.epoch, batch))
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("stopped")


@pytest.mark.torch
def test_a_grouped_fit_stopped_mid_epoch_resumes_as_the_uninterrupted_fit(tmp_path):
    """One device, where the steps read their batches a group at a time (JAX from arrays,
    TensorFlow with XLA, torch N steps per call), shuffled: Ctrl-C between two groups of an
    epoch, a rebuilt model, and the resumed fit (its replay of the epoch's first group) ends
    with the weights of the fit that was never stopped."""
    x, y = data(120)  # 8 batches an epoch, the last one padded; groups of 4 (save_freq).
    jit = True if keras.backend.backend() == "tensorflow" else "auto"

    def model(acc):
        with acc.scope():
            built = compiled_mlp(optimizer="adam", dropout=True)
            built.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=jit)
        return built

    kwargs = dict(batch_size=BATCH, epochs=3, verbose=0)
    acc = Accelerator(seed=0, devices=1)
    reference = model(acc)
    acc.fit(reference, x, y, **kwargs)

    acc = Accelerator(seed=0, devices=1)
    directory = str(tmp_path / "backup")
    stopped, stop = model(acc), StopInside(1, 3)
    with pytest.raises(KeyboardInterrupt):
        acc.fit(stopped, x, y, callbacks=[BackupAndRestore(directory, save_freq=4), stop], **kwargs)
    assert stop.seen == [(0, 3), (0, 7), (1, 3)]  # Groups of 4 steps, stopped between two.
    assert stopped.steps_per_execution == 1  # The model's own setting back after the stop.
    again = model(acc)
    history = acc.fit(again, x, y, callbacks=[BackupAndRestore(directory, save_freq=4)], **kwargs)
    assert history.epoch == [1, 2]
    for got, want in zip(again.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
