"""Steps on the device: N steps in one compiled program (JAX: `jax_groups.GroupedSteps`, a
scan; TensorFlow: Keras's while-loop, `fused.py`) give the numbers of one step per call.

The data (230 rows in batches of 16: 15 steps, the last batch padded) never divides into the
groups used (N = 4: three groups and a short one of 3; validation in a group of 4 and one
of 3; evaluation and prediction in the programs the fit compiled), so short groups,
padding, Dropout's random stream, a per-step schedule and BatchNormalization's statistics
all cross group boundaries."""

import os

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.conftest import BACKEND

ROWS, BATCH, N = 230, 16, 4
DEVICES = 8 if BACKEND == "jax" else min(2, int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8")))
# JAX: the same step, scanned, is bit-equal here (measured 0.0); 1e-6 allows for XLA fusing
# a scan body differently on another CPU. TensorFlow: see tests/adapter/test_fusion.py.
TOLERANCE = 1e-6 if BACKEND == "jax" else 1e-4


def _data(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = rng.integers(0, 3, rows).astype("int32")
    return x, y


def _run(n, jit_compile="auto"):
    acc = Accelerator(seed=0, devices=DEVICES, steps_per_execution=n, jit_compile=jit_compile)
    keras.utils.set_random_seed(1)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dropout(0.3),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3),
            ]
        )
        rate = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.8)
        model.compile(
            keras.optimizers.SGD(rate, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x, y = _data()
    vx, vy = _data(100, seed=1)  # 7 validation steps: a group of 4 and one of 3.
    history = acc.fit(model, x, y, batch_size=BATCH, epochs=2, verbose=0, validation_data=(vx, vy))
    evaluation = acc.evaluate(model, vx[:50], vy[:50], batch_size=BATCH, verbose=0)
    predictions = acc.predict(model, x, batch_size=BATCH, verbose=0)
    return acc, model, history.history, evaluation, predictions


@pytest.fixture(scope="module")
def runs():
    # JAX: N steps per call run as one scanned program only where measured faster (here,
    # with no trial, a program call per step), or where told (jit_compile=True): both ways.
    grouped = [_run(N)] + ([_run(N, jit_compile=True)] if BACKEND == "jax" else [])
    return _run(1), grouped


def test_groups_give_the_numbers_of_one_step_per_call(runs):
    (_, one, logs1, eval1, pred1), grouped = runs
    for _, model, logs_n, eval_n, pred_n in grouped:
        _assert_same(one, logs1, eval1, pred1, model, logs_n, eval_n, pred_n)


def _assert_same(one, logs1, eval1, pred1, grouped, logs_n, eval_n, pred_n):
    for a, b in zip(one.get_weights(), grouped.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(logs1[key], logs_n[key], rtol=TOLERANCE, err_msg=key)
    np.testing.assert_allclose(eval1, eval_n, rtol=TOLERANCE)
    assert pred_n.shape == (ROWS, 3)
    np.testing.assert_allclose(pred1, pred_n, rtol=TOLERANCE, atol=TOLERANCE)
    # The schedule moved at every step: 30 steps of decay, not 8 groups' worth.
    iterations = int(keras.ops.convert_to_numpy(grouped.optimizer.iterations))
    assert iterations == 30


def test_short_groups_and_shorter_calls_compile_nothing_more(runs):
    (acc1, *_), grouped = runs
    assert acc1.num_recompiles == 0
    for acc_n, *_ in grouped:
        assert acc_n.num_recompiles == 0
        # One trace of each step per program, whatever N: the step's compile time is N's.
        traced = [trace.kind for trace in acc_n.guard.traces]
        assert traced.count("train") == 1, acc_n.guard.traces


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's on-device groups")
def test_jax_runs_a_group_as_one_program(monkeypatch):
    """A group is a scan of ours (Keras 3.15 runs a host loop of N dispatches, 3.16 a scan
    of full groups and single steps for a short one); predictions are fused on "auto" too,
    each group in one shape."""
    from keras_accel.adapter.backends import jax_groups

    calls = []
    original = jax_groups.GroupedSteps.__call__

    def counted(self, state, iterator):
        calls.append((self.kind, self.model.steps_per_execution))
        return original(self, state, iterator)

    monkeypatch.setattr(jax_groups.GroupedSteps, "__call__", counted)
    acc = Accelerator(seed=0)
    with acc.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse")
    x = np.ones((100, 6), "float32")
    acc.fit(model, x, np.zeros((100, 3), "float32"), batch_size=10, epochs=1, verbose=0)
    assert acc.predict(model, x, batch_size=10, verbose=0).shape == (100, 3)
    assert calls == [("train", 10), ("predict", 10)], calls


def test_scan_steps_skips_the_slots_that_are_not_valid():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from keras_accel.adapter.backends.jax_groups import scan_steps

    def step(state, batch):
        return {"seen": batch}, state + batch

    stacked = jnp.asarray([1.0, 2.0, 3.0, 3.0])
    valid = jnp.asarray([True, True, True, False])
    last, state = scan_steps(step)(jnp.asarray(10.0), stacked, valid)
    assert float(state) == 16.0 and float(last["seen"]) == 3.0
    every, _ = scan_steps(step, outputs=True)(jnp.asarray(0.0), stacked, valid)
    assert every["seen"].tolist() == [1.0, 2.0, 3.0, 0.0]
