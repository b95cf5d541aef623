"""One process of a torch run (or the one-process reference) with `jit_compile=True`: Keras's
steps compiled (`torch_compiled`), over processes with their collectives in the program.
Usage: python _torch_compiled_processes.py OUT

45 rows in global batches of 8 (the last batch padded: 4 real rows in process 0, 1 in
process 1), SGD with momentum, accuracy; per model, `fit` for 2 epochs with validation
data (for the dense model one more epoch with the chief alone reading every batch's logs:
the metrics then reduced in the program too), then `evaluate`. Models: Dense-ReLU-Dense
(compiled in every process), and with BatchNormalization (its moments summed over the
processes: torch's compiler fails on that all-reduce) or a user's metric (its update
gathered from every process: torch cannot trace the gather), which every process then
runs eagerly alike (Dropout too: tests/adapter/test_torch_compiled.py has its note).
Every process writes what it saw, and how many compiled steps each model ran, to
OUT-<process>.npz.
"""

import sys

import keras
import numpy as np

from keras_accel import Accelerator
from keras_accel.adapter.backends.torch import compiled as torch_compiled

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


class RowCount(keras.metrics.Metric):
    """A user's metric (gathered from every process's rows over processes): the real rows
    seen, and the sum of their first predicted logits."""

    def __init__(self, name="rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.rows = self.add_variable((), "zeros", name="rows")
        self.logits = self.add_variable((), "zeros", name="logits")

    def update_state(self, y_true, y_pred, sample_weight=None):
        real = keras.ops.ones_like(y_pred[:, 0])
        if sample_weight is not None:
            real = keras.ops.cast(sample_weight > 0, y_pred.dtype)
        self.rows.assign_add(keras.ops.sum(real))
        self.logits.assign_add(keras.ops.sum(real * y_pred[:, 0]))

    def result(self):
        return self.logits / keras.ops.maximum(self.rows, 1.0)


def build(*middle, metric=None):
    with acc.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(8), *middle, keras.layers.Dense(3)]
        )
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", *([metric] if metric else [])],
            jit_compile=True,
        )
    return model


out = {}
# name: the layers between the two Dense, and whether the fit has validation data.
MODELS = {
    "dense": (keras.layers.ReLU(),),
    "batchnorm": (keras.layers.BatchNormalization(),),
    "users_metric": (keras.layers.ReLU(),),
}
for name, middle in MODELS.items():
    before = RUNS[0]
    model = build(*middle, metric=RowCount() if name == "users_metric" else None)
    history = acc.fit(
        model, x, y, batch_size=8, shuffle=False, epochs=2, validation_data=(x, y), verbose=0
    )
    for key, values in history.history.items():
        out[f"{name}/{key}"] = np.asarray(values)
    if name == "dense":  # The one model whose steps compile over processes.
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
