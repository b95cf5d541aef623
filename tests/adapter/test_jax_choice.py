"""JAX runs N steps per call as one scanned program or as a program call per step, whichever
was measured faster on the model (`keras_accel.adapter.choice`, `jax_groups.GroupedSteps`):
XLA on a CPU runs a convolution's gradient inside a loop about 100 times as slowly as
outside one, and a scan saves nothing but the host's per-call work. The numbers are the
same either way, and the times each way takes are given (`tests.helpers.timed_ways`)."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import timed_ways

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX's scanned groups")


@pytest.fixture
def ways_run(monkeypatch):
    """The way of every train unit of the grouped steps: ("compiled", steps) for a scan,
    ("plain", 1) for each program call of one step."""
    from keras_accel.adapter.backends import jax_groups

    ways = []
    one_step, program = jax_groups.GroupedSteps._one_step, jax_groups.GroupedSteps._program

    def spied_one(self, state):
        step = one_step(self, state)
        if self.kind != "train":
            return step

        def counted(*args):
            ways.append("plain")
            return step(*args)

        return counted

    def spied_program(self, state):
        scan = program(self, state)
        if self.kind != "train":
            return scan

        def counted(*args):
            ways.append("compiled")
            return scan(*args)

        return counted

    monkeypatch.setattr(jax_groups.GroupedSteps, "_one_step", spied_one)
    monkeypatch.setattr(jax_groups.GroupedSteps, "_program", spied_program)
    return ways


def _data(rows=192):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 12)).astype("float32")
    return x, keras.utils.to_categorical(rng.integers(0, 5, rows), 5)


def _fit(jit_compile="auto", epochs=4, capsys=None):
    x, y = _data()
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4, jit_compile=jit_compile)
    keras.utils.set_random_seed(1)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dropout(0.2),
                keras.layers.Dense(5, activation="softmax"),
            ]
        )
        model.compile("adam", "categorical_crossentropy", metrics=["accuracy"])
    history = acc.fit(model, x, y, batch_size=12, epochs=epochs, verbose=1 if capsys else 0)
    return acc, model, history.history


def test_a_scan_measured_faster_is_kept_with_the_numbers_of_a_call_per_step(
    monkeypatch, ways_run, capsys
):
    timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    acc, model, history = _fit(capsys=capsys)
    # 16 steps an epoch in 4 groups: steps one by one (the first group traces), the scan's
    # compilation, both in turn 3 times, then the scan.
    assert ways_run[:8] == ["plain"] * 8 and ways_run[-1] == "compiled"
    assert "runs its train steps as one scanned program per group" in capsys.readouterr().out
    assert acc.num_recompiles == 0  # The measurement's second program is no recompile.
    _, reference, want = _fit(jit_compile=False)  # A program call per step throughout.
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(history["loss"], want["loss"], rtol=1e-6)


def test_a_scan_far_slower_is_given_up_after_one_step(monkeypatch, ways_run):
    # A convolution's gradient in XLA:CPU's loop: 100 times as slow. With steps this long
    # (5 ms or more) the scan's trial runs single steps: its compilation, one timed step.
    timed_ways(monkeypatch, plain=6e-3, compiled=0.6)
    monkeypatch.setattr("keras_accel.adapter.backends.jax_groups.GroupedSteps.MOST_SAVED_S", 1.0)
    _fit()
    assert ways_run.count("compiled") == 2 and ways_run[-8:] == ["plain"] * 8


def test_steps_too_long_for_a_scan_to_matter_are_never_scanned(monkeypatch, ways_run, capsys):
    # A scan saves the host's per-call work (`MOST_SAVED_S`, 1 ms): nothing worth a trial
    # on steps of 50 ms.
    timed_ways(monkeypatch, plain=50e-3, compiled=1e-4)
    _fit(capsys=capsys)
    assert set(ways_run) == {"plain"}
    assert "could save only the host's per-call work" in capsys.readouterr().out


def test_the_argument_forces_either_way(monkeypatch, ways_run):
    units = timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    _fit(jit_compile=True, epochs=1)
    assert set(ways_run) == {"compiled"} and not units
    del ways_run[:]
    _fit(jit_compile=False, epochs=1)
    assert set(ways_run) == {"plain"} and not units
