"""One training run for the kill-and-resume test, in its own process.

Usage: python _resume_script.py WORKDIR RUN_NAME [KILL_AT]

Trains a small seeded model (Dense, BatchNormalization, Dropout; SGD with momentum) through
`Accelerator.fit` on 8 virtual CPU devices with BackupAndRestore (save_freq in steps),
History(path, per_step=True) and a step-mode LearningRateScheduler. With KILL_AT="E:B" the
process SIGKILLs itself at the end of batch B of epoch E (after the callbacks ran, so a
backup of the batches before may exist). At the end it writes the final weights to
WORKDIR/RUN_NAME.weights.npz.
"""

import os
import signal
import sys

import numpy as np

import keras_accel

keras_accel.configure_virtual_cpu_devices(8)

import keras  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from keras_accel.callbacks import (  # noqa: E402
    BackupAndRestore,
    History,
    LearningRateScheduler,
)
from keras_accel.schedules import PiecewiseConstant  # noqa: E402

EPOCHS = 3
BATCH = 16
ROWS = 100  # 7 batches per epoch, the last one padded (100 = 6 * 16 + 4).
SAVE_FREQ = 3


class KillAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    workdir, name = sys.argv[1], sys.argv[2]
    kill_at = sys.argv[3] if len(sys.argv) > 3 else None
    acc = Accelerator(seed=0)
    with acc.scope():
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
        BackupAndRestore(os.path.join(workdir, f"{name}.backup"), save_freq=SAVE_FREQ),
    ]
    if kill_at:
        epoch, batch = (int(part) for part in kill_at.split(":"))
        callbacks.append(KillAt(epoch, batch))
    acc.fit(
        model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0, callbacks=callbacks
    )
    np.savez(
        os.path.join(workdir, f"{name}.weights.npz"),
        *[np.asarray(w) for w in model.get_weights()],
        iterations=np.asarray(model.optimizer.iterations.numpy()),
    )


if __name__ == "__main__":
    main()
