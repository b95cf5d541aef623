"""One process of a torch run (or the one-process reference) with `jit_compile=True`: Keras's
steps compiled (`torch_compiled`), over processes with their collectives in the program.
Usage: python _torch_compiled_processes.py OUT

45 rows in global batches of 8 (the last batch padded: 4 real rows in process 0, 1 in
process 1), SGD with momentum, accuracy; per model, `fit` for 2 epochs with validation data,
one more epoch with the chief alone reading every batch's logs (the metrics then reduced in
the program too), then `evaluate`. Models: Dense-ReLU-Dense (compiled in every process),
and with BatchNormalization (its moments summed over the processes: torch's compiler fails
on that all-reduce) or Dropout (torch cannot compile Keras's draws), which every process
then runs eagerly alike. Every process writes what it saw, and how many compiled steps
each model ran, to OUT-<process>.npz.
"""

import sys

import keras
import numpy as np

from keras_accel import Accelerator
from keras_accel.adapter.backends import torch_compiled

# Every call of a compiled program, counted.
RUNS = [0]
_program = torch_compiled._program


def _counted_program(model, kind):
    run = _program(model, kind)

    def counted(*args):
        RUNS[0] += 1
        return run(*args)

    return counted


torch_compiled._program = _counted_program
acc = Accelerator(seed=0)
rng = np.random.default_rng(0)
x = rng.normal(size=(45, 5)).astype("float32")
y = rng.integers(0, 3, 45).astype("int32")


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([logs["loss"], logs["accuracy"]])


def build(*middle):
    with acc.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8), *middle, keras.layers.Dense(3)]
        )
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=True,
        )
    return model


out = {}
# name: the layers between the two Dense, and whether the fit has validation data.
MODELS = {
    "dense": (keras.layers.ReLU(),),
    "batchnorm": (keras.layers.BatchNormalization(),),
    "dropout": (keras.layers.Dropout(0.3, seed=5),),
}
for name, middle in MODELS.items():
    before = RUNS[0]
    model = build(*middle)
    history = acc.fit(
        model, x, y, batch_size=8, shuffle=False, epochs=2, validation_data=(x, y), verbose=0
    )
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        out[f"{name}/{key}"] = np.asarray(history.history[key])
    logs = BatchLogs()
    acc.fit(
        model,
        x,
        y,
        batch_size=8,
        shuffle=False,
        callbacks=[logs] if acc.process_index == 0 else [],
        verbose=0,
    )
    if acc.process_index == 0:
        out[f"{name}/batch_logs"] = np.asarray(logs.seen)
    out[f"{name}/evaluate"] = np.asarray(acc.evaluate(model, x, y, batch_size=8, verbose=0))
    for i, w in enumerate(model.get_weights()):
        out[f"{name}/w{i}"] = w
    out[f"runs/{name}"] = np.asarray(RUNS[0] - before)
np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **out)
