"""Users' metrics whose state is not a sum, and per-row random layers, over every replica
(JAX and TensorFlow; torch's processes: tests/adapter/test_torch.py), against plain
single-device Keras.

A running maximum kept in a variable of Keras's default aggregation ("sum"), and a row count
whose `result()` returns its variable itself, on a model with `Dropout(0.3, seed=5)` and
`GaussianNoise(0.5, seed=2)`; 45 rows in batches of 8: the last batch holds 5 rows, padded,
so on 8 replicas 3 replicas hold only padding there.

JAX's arrays are global: one program updates one state and draws one mask. TensorFlow's
replicas each hold their own copy of a metric's variables, summed when read, and each runs
the model on its own rows: before, 8 replicas reported 8 maxima summed (5.66 where one
device reports 0.77) and trained elsewhere than one device through the Dropout (losses 0.3
apart after 2 epochs).
"""

import os

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from tests.conftest import BACKEND

DEVICES = int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8"))
ROWS, BATCH = 45, 8
NAMES = ("loss", "running_max", "rows")
# The gradient's sum over replicas in another order: float32 rounding, over 12 steps.
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(BACKEND == "torch", reason="torch: tests/adapter/test_torch.py")


class RunningMax(keras.metrics.Metric):
    """The largest predicted probability seen on a real row (weight > 0)."""

    def __init__(self, name="running_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.value = self.add_variable((), "zeros", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        values = ops.max(ops.softmax(y_pred), axis=-1)
        if sample_weight is not None:
            values = values * ops.cast(ops.reshape(sample_weight, (-1,)) > 0, values.dtype)
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
        # Plain Keras on JAX cannot return a Variable from a compiled step: its value there.
        return self.count.value if BACKEND == "jax" else self.count


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 5)).astype("float32"), rng.integers(0, 3, ROWS)


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16),
            keras.layers.Dropout(0.3, seed=5),
            keras.layers.GaussianNoise(0.5, seed=2),
            keras.layers.Dense(3),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[RunningMax(), RowCount()],
    )
    return model


def _numbers(logs):
    return {name: np.asarray(logs[name], "float64") for name in NAMES}


def _close(got, want, err_msg=""):
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, err_msg=err_msg)


@pytest.fixture(scope="module")
def plain():
    x, y = _data()
    model = _model()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return _numbers(history.history), _numbers(evaluated), model.get_weights()


def test_fit_and_evaluate_equal_one_device(plain):
    fit, evaluate, weights = plain
    x, y = _data()
    acc = Accelerator(devices=DEVICES)
    with acc.scope():
        model = _model()
    history = acc.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), weights):
        _close(got, want)
    evaluated = acc.evaluate(model, x, y, batch_size=BATCH, verbose=0, return_dict=True)
    for got, want in ((_numbers(history.history), fit), (_numbers(evaluated), evaluate)):
        for name in NAMES:
            _close(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(evaluate["rows"], 45.0)
    # Read after the call, outside any step, as a callback or the user would.
    metrics = {m.name: m for m in model.metrics[-1].metrics}
    _close(ops.convert_to_numpy(metrics["running_max"].result()), evaluate["running_max"])
    assert float(ops.convert_to_numpy(metrics["rows"].result())) == 45.0


def test_the_custom_loop_equals_one_device(plain):
    _, evaluate, weights = plain
    x, y = _data()
    acc = Accelerator(devices=DEVICES)
    with acc.scope():
        model = _model()
        metrics = [RunningMax(), RowCount()]
    loop = acc.loop(model, metrics=metrics)
    for epoch in range(2):
        loop.reset_metrics()
        for batch in loop.batches(x, y, batch_size=BATCH, epoch=epoch):
            loop.train_step(batch)
        assert loop.results()["rows"] == 45.0
    for got, want in zip(model.get_weights(), weights):
        _close(got, want)
    got = loop.evaluate(x, y, batch_size=BATCH)
    for name in NAMES:
        _close(got[name], evaluate[name], err_msg=name)
