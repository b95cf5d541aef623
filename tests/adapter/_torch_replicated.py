"""One process of a torch run whose last partial batch reaches code that weights no rows, so
that every process runs it whole (`remainder="replicate"`, docs/accelerator.md "Padded,
unpadded or dropped"): each process trains through `Accelerator.fit` and a plain Keras twin
on the whole data itself, from the same weights. Usage: python _torch_replicated.py OUT;
every process writes OUT-<process>.npz, keys "<case>/<what>/ours" and "<case>/<what>/one".

- "custom": a `train_step` and `test_step` of the model's own that hand on no weights (Keras's
  guide's pattern), through seeded Dropout and BatchNormalization (whose moments are summed
  across processes in every other step), Adam, Keras's metric and a user's metric whose state
  is not a sum (a running maximum: updated on the global batch's rows, gathered);
- "compiled": Keras's own steps, compiled (`jit_compile=True`: the other steps run as one
  program with the collectives in it; the replicated one eagerly), a layer's `add_loss`, and
  a compiled loss with `reduction="sum"` (which each process scales by the process count
  where gradients are averaged, and not in the replicated step). Its twin runs eagerly.

- "generator", "pydataset": "custom" fed by a stream read in Python, each batch with padding
  marked as it comes (no validation).

37 rows in batches of 8: the last batch has 5 real rows; 13 validation rows, 11 evaluated.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import functools  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from tests.adapter.test_torch_compiled import Penalty  # noqa: E402
from tests.helpers import keep_pair  # noqa: E402

rng = np.random.default_rng(0)
x, y = rng.normal(size=(37, 5)).astype("float32"), rng.integers(0, 3, 37)
x_val, y_val = rng.normal(size=(13, 5)).astype("float32"), rng.integers(0, 3, 13)
x_test, y_test = rng.normal(size=(11, 5)).astype("float32"), rng.integers(0, 3, 11)


class MaxProbability(keras.metrics.Metric):
    """The largest predicted probability seen: a state no sum over processes gives."""

    def __init__(self, name="max_probability"):
        super().__init__(name=name)
        self.largest = self.add_variable((), "zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        largest = keras.ops.max(keras.ops.softmax(y_pred))
        self.largest.assign(keras.ops.maximum(self.largest, largest))

    def result(self):
        return self.largest


class Custom(keras.Model):
    def __init__(self):
        super().__init__()
        self.body = keras.Sequential(
            [
                keras.layers.Dense(16, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.3, seed=5),
                keras.layers.Dense(3),
            ]
        )
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.largest = MaxProbability()

    def call(self, inputs, training=False):
        return self.body(inputs, training=training)

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy, self.largest]

    def train_step(self, data):
        import torch

        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred)
        loss.backward()
        trainable = self.trainable_weights
        self.optimizer.apply([v.value.grad for v in trainable], trainable)
        with torch.no_grad():
            return self._update(loss, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        return self._update(self.compute_loss(x, y, y_pred), y, y_pred)

    def _update(self, loss, y, y_pred):
        self.loss_tracker.update_state(loss)
        self.accuracy.update_state(y, y_pred)
        self.largest.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom():
    keras.utils.set_random_seed(1)
    model = Custom()
    model.compile(
        keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model(x[:2])
    return model


def compiled():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            Penalty(),
            keras.layers.Dense(3),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model.compile(keras.optimizers.SGD(0.05), loss, metrics=["accuracy"], jit_compile=True)
    return model


acc = Accelerator(seed=0)
out = {}

keep = functools.partial(keep_pair, out)


for name, make in (("custom", custom), ("compiled", compiled)):
    with acc.scope():
        ours = make()
    twin = make()
    twin.jit_compile = False  # Plain Keras's torch default: eager.
    twin.set_weights(ours.get_weights())
    fit = dict(batch_size=8, epochs=3, shuffle=False, verbose=0, validation_data=(x_val, y_val))
    keras.utils.set_random_seed(7)
    expected = twin.fit(x, y, **fit).history
    keras.utils.set_random_seed(7)
    history = acc.fit(ours, x, y, **fit).history
    assert sorted(history) == sorted(expected), (sorted(history), sorted(expected))
    for key in expected:
        keep(name, f"history.{key}", history[key], expected[key])
    keep(name, "weights", ours.get_weights(), twin.get_weights())
    evaluate = dict(batch_size=8, verbose=0, return_dict=True)
    expected = twin.evaluate(x_test, y_test, **evaluate)
    got = acc.evaluate(ours, x_test, y_test, **evaluate)
    for key in expected:
        keep(name, f"evaluate.{key}", got[key], expected[key])


def batches_of(a, b):
    for start in range(0, len(a), 8):
        yield a[start : start + 8], b[start : start + 8]


class Batches(keras.utils.PyDataset):
    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def __len__(self):
        return -(-len(self.a) // 8)

    def __getitem__(self, i):
        return self.a[i * 8 : (i + 1) * 8], self.b[i * 8 : (i + 1) * 8]


# Streams read in Python: every process reads the same stream and keeps its share of each
# batch, and the short one (marked as it comes) whole.
for name, source in (("generator", batches_of), ("pydataset", Batches)):
    with acc.scope():
        ours = custom()
    twin = custom()
    twin.set_weights(ours.get_weights())
    keras.utils.set_random_seed(7)
    expected = twin.fit(source(x, y), epochs=1, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(7)
    history = acc.fit(ours, source(x, y), epochs=1, shuffle=False, verbose=0).history
    for key in expected:
        keep(name, f"history.{key}", history[key], expected[key])
    keep(name, "weights", ours.get_weights(), twin.get_weights())
    expected = twin.evaluate(source(x_test, y_test), verbose=0, return_dict=True)
    got = acc.evaluate(ours, source(x_test, y_test), verbose=0, return_dict=True)
    for key in expected:
        keep(name, f"evaluate.{key}", got[key], expected[key])
np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **out)
