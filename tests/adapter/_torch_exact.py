"""One process of a torch run (or the one-process reference) for what must not depend on the
process count: custom metrics, per-row randomness and BatchNormalization's moments. Usage:
python _torch_exact.py OUT

45 rows in global batches of 8 (the last batch holds 5 rows: padded, 4 real rows in process
0 and 1 in process 1), through `Accelerator.fit`, `evaluate` (also of a model whose own
`test_step` updates them) and the custom loop:

- `RunningMax`, a running maximum stored in a variable of Keras's default aggregation "sum"
  (summing the processes' maxima would be wrong);
- `RowCount`, whose `result()` returns its variable itself (read outside any reduction);
- `Dropout(0.3, seed=5)`, an unseeded `GaussianNoise` (Keras's seed generator, its seed
  drawn from the seeded Python generator) and an unseeded `Dropout(0.2)` (Keras's torch
  backend draws it from torch's global generator, which `Accelerator(seed=0)` seeds alike
  in every process), training: the global batch's draw, not one draw repeated in every
  process;
- keras-io's timeseries classifier (Conv1D -> BatchNormalization -> ReLU, Adam) on series
  far from zero (`tests.helpers.series_far_from_zero`), where a variance taken as
  E[x^2] - E[x]^2 depends on the order of its sums far beyond float rounding.

Every process writes what it saw to OUT-<process>.npz.
"""

import os
import sys

import keras
import numpy as np
from keras import ops

from keras_accel import Accelerator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.helpers import series_far_from_zero, timeseries_classifier  # noqa: E402


class RunningMax(keras.metrics.Metric):
    """The largest predicted probability seen on a real row (weight > 0)."""

    def __init__(self, name="running_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.value = self.add_variable((), "zeros", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        values = ops.max(ops.softmax(y_pred), axis=-1)
        if sample_weight is not None:
            values = values * ops.cast(sample_weight > 0, values.dtype)
        self.value.assign(ops.maximum(self.value, ops.max(values)))

    def result(self):
        return ops.convert_to_tensor(self.value)


class RowCount(keras.metrics.Metric):
    """The number of real rows seen; `result()` is the variable itself."""

    def __init__(self, name="rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.count = self.add_variable((), "zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        rows = ops.ones_like(y_true, "float32") if sample_weight is None else sample_weight
        self.count.assign_add(ops.sum(ops.cast(rows, "float32")))

    def result(self):
        return self.count


acc = Accelerator(seed=0)
rng = np.random.default_rng(0)
x = rng.normal(size=(45, 5)).astype("float32")
y = rng.integers(0, 3, 45).astype("int32")
BATCH = 8
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

with acc.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16),
            keras.layers.Dropout(0.3, seed=5),
            keras.layers.GaussianNoise(0.5),
            keras.layers.Dropout(0.2),  # Unseeded: torch's own generator, seeded alike.
            keras.layers.Dense(3),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1), LOSS, metrics=[RunningMax(), RowCount()])
start = [w.copy() for w in model.get_weights()]
out = {}
history = acc.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
for name in ("loss", "running_max", "rows"):
    out[f"fit/{name}"] = np.asarray(history.history[name])
for i, w in enumerate(model.get_weights()):
    out[f"fit/w{i}"] = w
evaluated = acc.evaluate(model, x, y, batch_size=7, verbose=0, return_dict=True)
for name in ("loss", "running_max", "rows"):
    out[f"evaluate/{name}"] = np.asarray(evaluated[name])

# The custom loop, from the same start, with its own metrics.
model.set_weights(start)
with acc.scope():
    optimizer = keras.optimizers.SGD(0.1)
loop = acc.loop(model, optimizer=optimizer, loss=LOSS, metrics=[RunningMax(), RowCount()])
for epoch in range(2):
    loop.reset_metrics()
    for batch in loop.batches(x, y, batch_size=BATCH, epoch=epoch):
        loop.train_step(batch)
    for name, value in loop.results().items():
        out.setdefault(f"loop/{name}", []).append(value)
for i, w in enumerate(model.get_weights()):
    out[f"loop/w{i}"] = w
for name, value in loop.evaluate(x, y, batch_size=7).items():
    out[f"loop_evaluate/{name}"] = np.asarray(value)


class Peaked(keras.Model):
    """A custom test step that updates a user's metric itself (tracked on the model)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.peak = RunningMax(name="peak")
        self.rows = RowCount(name="rows")

    def call(self, inputs):
        return self.dense(inputs)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        self.peak.update_state(y, y_pred, sample_weight)
        self.rows.update_state(y, y_pred, sample_weight)
        return {"peak": self.peak.result(), "rows": self.rows.result()}


with acc.scope():
    keras.utils.set_random_seed(2)
    peaked = Peaked()
    peaked.compile(keras.optimizers.SGD(0.1), LOSS)
for name, value in acc.evaluate(peaked, x, y, batch_size=7, verbose=0, return_dict=True).items():
    out[f"custom_step/{name}"] = np.asarray(value)

# BatchNormalization's moments on data far from zero: the same seeded weights in every run.
with acc.scope():
    series = timeseries_classifier()
series_x, series_y = series_far_from_zero()
history = acc.fit(series, series_x, series_y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
out["batchnorm/loss"] = np.asarray(history.history["loss"])
for i, w in enumerate(series.get_weights()):
    out[f"batchnorm/w{i}"] = w
np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **{k: np.asarray(v) for k, v in out.items()})
