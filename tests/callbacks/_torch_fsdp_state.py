"""BackupAndRestore under torch fsdp: one stage of tests/callbacks/test_torch_fsdp_state.py.

Usage: keras-accel launch -n 2 _torch_fsdp_state.py WORKDIR (the stage "two"); the test
runs the one-process stages "one" (before) and "back" (after) in its own process.

- "one" (one process): the uninterrupted fit ("one/straight"), and a fit stopped by an
  exception mid-epoch that leaves its backups in WORKDIR/one.backup;
- "two" (two processes, strategy="fsdp"): the same uninterrupted ("two/straight"); the
  fit stopped, its backups kept (WORKDIR/two.kept, a copy); the fit run again, resumed
  from them ("two/resumed"), and under data_parallel ("two_to_data_parallel"); and the
  one process's backups resumed ("one_to_two");
- "back" (one process): the two processes' backups resumed under fsdp and under
  data_parallel ("two_to_one/fsdp", "two_to_one/data_parallel").

Each fit: 37 rows in global batches of 8 (the last padded), Dense -> BatchNormalization ->
Dropout -> Dense, Adam, the metric "mae", a backup every 3 steps. Each stage gives what it
saw (history, weights and optimizer variables, whole); each process of "two" writes it to
WORKDIR/two-<process>.npz.
"""

import os
import shutil
import sys

import keras
import numpy as np

from keras_accel import Accelerator
from keras_accel.callbacks import BackupAndRestore
from keras_accel.utils import process

EPOCHS, BATCH, SAVE_FREQ = 3, 8, 3
STOP = (1, 2)  # The end of batch 2 of epoch 1: step 8; the last backup is step 6's, mid-epoch.


class StopAt(keras.callbacks.Callback):
    """Raises at the end of batch `STOP`, after BackupAndRestore's hook of that batch."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == STOP:
            raise RuntimeError("stopped")


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(37, 6)).astype("float32"), rng.normal(size=(37, 3)).astype("float32")


def fit(workdir, strategy, backup=None, stop=False):
    """A new model fitted under `strategy`; its history, weights and optimizer variables."""
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    acc = Accelerator(strategy=strategy, seed=0)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.3, seed=5),
                keras.layers.Dense(3),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    callbacks = []
    if backup is not None:
        callbacks.append(BackupAndRestore(os.path.join(workdir, backup), save_freq=SAVE_FREQ))
    if stop:
        callbacks.append(StopAt())
    x, y = data()
    try:
        history = acc.fit(
            model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
            callbacks=callbacks,
        )  # fmt: skip
    except RuntimeError as error:
        assert stop and str(error) == "stopped", error
        return acc, None
    out = {f"history/{k}": np.asarray(v) for k, v in history.history.items()}
    out["epochs"] = np.asarray(history.epoch)
    for v in [*model.weights, *model.optimizer.variables]:
        out[f"var/{v.path}"] = np.asarray(v.numpy())
    return acc, out


def keep(out, name, result):
    out.update({f"{name}/{k}": v for k, v in result.items()})


def copy(workdir, source, target):
    shutil.copytree(os.path.join(workdir, source), os.path.join(workdir, target))


def one(workdir) -> dict:
    """One process: the uninterrupted fit, and the stopped one's backups."""
    out = {}
    keep(out, "one/straight", fit(workdir, "fsdp")[1])
    fit(workdir, "fsdp", "one.backup", stop=True)
    return out


def two(workdir) -> dict:
    """Two processes: see the module docstring."""
    out = {}
    keep(out, "two/straight", fit(workdir, "fsdp")[1])
    acc, _ = fit(workdir, "fsdp", "two.backup", stop=True)
    if acc.is_chief:  # What the stopped fits left, before a resumed fit deletes it.
        copy(workdir, "two.backup", "two.kept")
        copy(workdir, "two.backup", "two.data_parallel")
        copy(workdir, "one.backup", "one.copy")
    process.barrier("copied")
    keep(out, "two/resumed", fit(workdir, "fsdp", "two.backup")[1])
    keep(out, "two_to_data_parallel", fit(workdir, "data_parallel", "two.data_parallel")[1])
    keep(out, "one_to_two", fit(workdir, "fsdp", "one.copy")[1])
    return out


def back(workdir) -> dict:
    """One process: the two processes' backups resumed under fsdp and data_parallel."""
    out = {}
    for strategy in ("fsdp", "data_parallel"):
        copy(workdir, "two.kept", f"two.{strategy}")
        keep(out, f"two_to_one/{strategy}", fit(workdir, strategy, f"two.{strategy}")[1])
    return out


if __name__ == "__main__":
    workdir = sys.argv[1]
    result = two(workdir)
    np.savez(os.path.join(workdir, f"two-{process.process_index()}.npz"), **result)
