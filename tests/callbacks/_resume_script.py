"""One training run for the kill-and-resume test, in its own process.

Usage: python _resume_script.py WORKDIR RUN_NAME [KILL_AT] [OPTION=VALUE ...]

Trains a small seeded model (Dense, BatchNormalization, Dropout; SGD with momentum) through
`Accelerator.fit` on 8 virtual CPU devices (2 on TensorFlow, one on torch) with BackupAndRestore
(save_freq in steps), History(path, per_step=True) and a step-mode LearningRateScheduler.
With KILL_AT="E:B" the process SIGKILLs itself at the end of batch B of epoch E (after the
callbacks ran, so a backup of the batches before may exist), or sends itself the signal
that `kill_with` names. At the end it writes the final
weights to WORKDIR/RUN_NAME.weights.npz.

Options:
- `named=enc,bn,drop,head`: the same layers as a functional model of named layers, created
  in the order given (always wired enc -> bn -> relu -> drop -> head); the weights file is
  then keyed by variable path ("/" written as "|");
- `save_freq=epoch` (or a number of batches; default 3);
- `backup_root=URL`: keep the backup in URL/RUN_NAME.backup (an s3:// or gs:// bucket)
  instead of WORKDIR;
- `kill_with=SIGTERM`: the signal KILL_AT sends (default SIGKILL); SIGTERM is a cloud's
  preemption, which BackupAndRestore answers with a backup and exit code 143;
- `raise_after=E`: a RuntimeError out of `on_epoch_end` of epoch E, after BackupAndRestore
  handed that epoch's backup to the engine: the exception ends `fit` (Keras then skips
  `on_train_end`) and the process, uncaught.

Every run appends the epochs it begins to WORKDIR/RUN_NAME.epochs, one line per process.
"""

import os
import signal
import sys

import numpy as np

import keras_accel

# On torch one process is one device (the test's torch run compares one process with one).
# TensorFlow on 2: it traces every step once per replica in each of the test's processes,
# and the subject here is the backup, not the replica count (tests/helpers.FEW_REPLICAS).
DEVICES = {"torch": 1, "tensorflow": 2}.get(os.environ.get("KERAS_BACKEND"), 8)
keras_accel.configure_virtual_cpu_devices(DEVICES)

import keras  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from keras_accel.callbacks import (  # noqa: E402
    BackupAndRestore,
    History,
    LearningRateScheduler,
)
from keras_accel.schedules import PiecewiseConstant  # noqa: E402
from keras_accel.state import files  # noqa: E402

EPOCHS = 3
BATCH = 16
ROWS = 100  # 7 batches per epoch, the last one padded (100 = 6 * 16 + 4).
SAVE_FREQ = 3


class KillAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch, signum=signal.SIGKILL):
        super().__init__()
        self.at, self.signum = (epoch, batch), signum
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), self.signum)


class RaiseAfter(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"Crash after epoch {epoch}")


class RecordEpochs(keras.callbacks.Callback):
    def __init__(self, path):
        super().__init__()
        self.path, self.begun = path, []

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)
        with open(self.path, "a") as f:
            f.write(("" if len(self.begun) == 1 else " ") + str(epoch))

    def on_train_begin(self, logs=None):
        with open(self.path, "a") as f:
            f.write("\n")


def _layers(order):
    make = {
        "enc": lambda: keras.layers.Dense(
            16, name="enc", kernel_initializer=keras.initializers.GlorotUniform(0)
        ),
        "bn": lambda: keras.layers.BatchNormalization(name="bn"),
        "drop": lambda: keras.layers.Dropout(0.3, seed=1, name="drop"),
        "head": lambda: keras.layers.Dense(
            3, name="head", kernel_initializer=keras.initializers.GlorotUniform(1)
        ),
    }
    return {name: make[name]() for name in order}


def main():
    workdir, name = sys.argv[1], sys.argv[2]
    extra = sys.argv[3:]
    kill_at = next((arg for arg in extra if "=" not in arg), None)
    options = dict(arg.split("=", 1) for arg in extra if "=" in arg)
    save_freq = options.get("save_freq", str(SAVE_FREQ))
    save_freq = save_freq if save_freq == "epoch" else int(save_freq)
    acc = Accelerator(seed=0)
    with acc.scope():
        if "named" in options:
            layers = _layers(options["named"].split(","))
            inputs = keras.Input((6,))
            hidden = keras.layers.ReLU(name="relu")(layers["bn"](layers["enc"](inputs)))
            model = keras.Model(inputs, layers["head"](layers["drop"](hidden)))
        else:
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(16, kernel_initializer=keras.initializers.GlorotUniform(0)),
                    keras.layers.BatchNormalization(),
                    keras.layers.ReLU(),
                    keras.layers.Dropout(0.3, seed=1),
                    keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(1)),
                ]
            )
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    callbacks = [
        LearningRateScheduler(
            PiecewiseConstant([0.1, 0.03, 0.01], boundaries=[0.3, 0.6], unit="fraction"),
            update_freq="step",
        ),
        History(path=os.path.join(workdir, f"{name}.history.json"), per_step=True),
        BackupAndRestore(
            files.join(options.get("backup_root", workdir), f"{name}.backup"),
            save_freq=save_freq,
        ),
        RecordEpochs(os.path.join(workdir, f"{name}.epochs")),
    ]
    if kill_at:
        epoch, batch = (int(part) for part in kill_at.split(":"))
        signum = signal.Signals[options.get("kill_with", "SIGKILL")]
        callbacks.append(KillAt(epoch, batch, signum))
    if "raise_after" in options:
        callbacks.append(RaiseAfter(int(options["raise_after"])))
    acc.fit(
        model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=callbacks
    )
    if "named" in options:
        weights = {v.path.replace("/", "|"): np.asarray(v.numpy()) for v in model.variables}
    else:
        weights = {f"arr_{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    np.savez(
        os.path.join(workdir, f"{name}.weights.npz"),
        **weights,
        iterations=np.asarray(model.optimizer.iterations.numpy()),
    )


if __name__ == "__main__":
    main()
