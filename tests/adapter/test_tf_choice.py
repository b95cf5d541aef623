"""TensorFlow on one device runs each group of steps as one program, with XLA or as
TensorFlow's graph, whichever was measured faster on the model itself
(`keras_accel.adapter.choice`, `fused.GroupRunner`): the same numbers as plain Keras either
way, the model's `jit_compile` as it was, one note, nothing counted as a recompile, and no
list of layers: whatever the model holds, the measurement decides. The times each way
takes are given (`tests.helpers.timed_ways`), so that a loaded machine decides nothing."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import timed_ways

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's XLA or graph groups"
)


@pytest.fixture
def ways_run(monkeypatch):
    """The way of every program call of the group runners' train steps
    (`GroupRunner._program`)."""
    from keras_accel.adapter.backends.tensorflow import fused

    ways = []

    def spy(program):
        def spied(self, path, spec, data):
            if self.kind == "train":
                ways.append(path)
            return program(self, path, spec, data)

        return spied

    for name in ("_program", "_stacked_program"):  # Gathered in the program, or on the host.
        monkeypatch.setattr(fused.GroupRunner, name, spy(getattr(fused.GroupRunner, name)))
    return ways


def _data(rows=192):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 12)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 5, rows), 5)
    return x, y


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(5, activation="softmax")

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def _times_one_without_xla(t):
    import tensorflow as tf

    # `index_shuffle` has no XLA kernel: XLA refuses to compile a step that holds it.
    index = tf.cast(tf.reduce_sum(t) > 1e9, tf.int64)[tf.newaxis]
    seed = tf.constant([1, 2], tf.int64)
    shuffled = tf.random.experimental.index_shuffle(index, seed=seed, max_index=5)
    return t * tf.cast(tf.reduce_sum(shuffled) >= 0, t.dtype)


def _model(acc, kind="dense", **compile_kwargs):
    keras.utils.set_random_seed(1)
    with acc.scope():
        if kind == "subclassed":
            model = Subclassed()
        else:
            layers = [keras.Input((12,))]
            if kind == "conv":
                layers += [keras.layers.Reshape((3, 4, 1)), keras.layers.Conv2D(2, 2)]
                layers.append(keras.layers.Flatten())
            if kind == "no_xla":
                layers.append(keras.layers.Lambda(_times_one_without_xla))
            layers.append(keras.layers.Dense(16, activation="relu"))
            if kind == "dropout":
                layers.append(keras.layers.Dropout(0.3))
            if kind == "text":
                layers += [keras.layers.LayerNormalization()]
            model = keras.Sequential([*layers, keras.layers.Dense(5, activation="softmax")])
        model.compile(
            keras.optimizers.Adam(1e-2),
            "categorical_crossentropy",
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


def _assert_plain_kerass(model, history, kind, x, y, epochs, **fit_kwargs):
    reference = _model(Accelerator(seed=0, devices=1), kind)  # Keras's "auto": the graph.
    want = reference.fit(x, y, batch_size=12, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    for got, expected in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, atol=1e-5)


def test_xla_measured_faster_runs_with_plain_kerass_numbers_is_said_and_leaves_no_trace(
    monkeypatch, ways_run, capsys
):
    timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    x, y = _data()
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
    model = _model(acc, "text")
    assert model.jit_compile is False  # Keras's "auto" on a CPU-only machine.
    history = acc.fit(
        model, x, y, batch_size=12, epochs=3, validation_data=(x, y), shuffle=False, verbose=1
    )
    # 16 batches an epoch (one of 12 rows) in 4 groups: a plain group (traced), one timed,
    # the compiled way's first (its compilation), both in turn 3 times, then XLA.
    plain, compiled = "plain", "compiled"
    trial = [plain, plain, compiled] + [compiled, plain] * 3
    assert ways_run == trial + [compiled] * (12 - len(trial))
    assert model.jit_compile is False  # The model is as it was.
    out = capsys.readouterr().out
    assert out.count("runs its train steps as one XLA program per group") == 1
    assert "a step as TensorFlow's graph" in out and "measured on its own steps" in out
    _assert_plain_kerass(model, history, "text", x, y, 3, validation_data=(x, y))

    # Its later calls keep XLA, and nothing is counted as a recompile.
    del ways_run[:]
    acc.fit(model, x, y, batch_size=12, epochs=1, verbose=0)
    assert set(ways_run) == {"compiled"}
    assert acc.num_recompiles == 0
    assert model.jit_compile is False


@pytest.mark.parametrize("kind", ["dropout", "conv", "subclassed"])
def test_any_model_is_measured_no_list_of_layers(monkeypatch, ways_run, kind):
    timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    x, y = _data(96)
    acc = Accelerator(seed=0, devices=1, steps_per_execution=2)
    model = _model(acc, kind)
    history = acc.fit(model, x, y, batch_size=12, epochs=4, shuffle=False, verbose=0)
    assert "compiled" in ways_run and ways_run[-1] == "compiled"
    if kind == "dropout":  # XLA draws other random numbers than TensorFlow's kernels.
        assert np.isfinite(history.history["loss"]).all()
    else:
        _assert_plain_kerass(model, history, kind, x, y, 4)


def test_xla_measured_slower_keeps_the_graph(monkeypatch, ways_run):
    timed_ways(monkeypatch, plain=1e-4, compiled=1e-3)
    x, y = _data()
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
    model = _model(acc)
    acc.fit(model, x, y, batch_size=12, epochs=4, verbose=0)
    assert "compiled" in ways_run[:5] and ways_run[-6:] == ["plain"] * 6


@pytest.mark.parametrize("case", ["argument", "environment", "replicas", "eager"])
def test_where_the_way_is_not_measured(monkeypatch, ways_run, case):
    units = timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    x, y = _data()
    setting = {"argument": False}.get(case, "auto")
    acc = Accelerator(seed=0, devices=2 if case == "replicas" else 1, jit_compile=setting)
    if case == "environment":
        monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE", "0")
    model = _model(acc, run_eagerly=case == "eager")
    acc.fit(model, x, y, batch_size=12, epochs=3, verbose=0)
    assert not units  # Nothing timed:
    if case in ("argument", "environment"):  # the graph, as told;
        assert set(ways_run) == {"plain"}
    else:  # no groups at all: the batches one by one, as Keras's step runs them.
        assert not ways_run


def test_a_model_compiled_with_xla_is_measured_between_a_launch_per_step_and_one_per_group(
    monkeypatch, ways_run, capsys
):
    # XLA:CPU runs a convolution's gradient 100 times as slowly in its while loop as in a
    # launch of its own: the group program can lose even where the model asks for XLA.
    timed_ways(monkeypatch, plain=1e-4, compiled=1e-3)
    x, y = _data(96)
    acc = Accelerator(seed=0, devices=1, steps_per_execution=2)
    model = _model(acc, "conv", jit_compile=True)
    history = acc.fit(model, x, y, batch_size=12, epochs=4, shuffle=False, verbose=1)
    assert "compiled" in ways_run and ways_run[-4:] == ["plain"] * 4
    assert "runs its train steps as one XLA launch per step" in capsys.readouterr().out
    assert model.jit_compile is True
    reference = _model(Accelerator(seed=0, devices=1), "conv", jit_compile=True)
    want = reference.fit(x, y, batch_size=12, epochs=4, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-4)


def test_steps_that_are_not_whole_passes_are_read_on_the_host_and_measured_too(
    monkeypatch, ways_run
):
    units = timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    x, y = _data()
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
    model = _model(acc)
    history = acc.fit(model, x, y, batch_size=12, epochs=6, steps_per_epoch=8, verbose=0)
    assert units and ways_run[-1] == "compiled"
    assert len(history.history["loss"]) == 6


def test_a_step_xla_cannot_compile_runs_as_the_graph_with_plain_kerass_numbers(
    monkeypatch, ways_run, capsys
):
    timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    x, y = _data(96)
    acc = Accelerator(seed=0, devices=1, steps_per_execution=2)
    model = _model(acc, "no_xla")
    history = acc.fit(model, x, y, batch_size=12, epochs=3, shuffle=False, verbose=1)
    assert ways_run.count("compiled") == 1 and ways_run[-1] == "plain"
    assert "compiling them failed (InvalidArgumentError" in capsys.readouterr().out
    _assert_plain_kerass(model, history, "no_xla", x, y, 3)


def test_the_decision_is_remembered_for_the_same_architecture(monkeypatch, ways_run, tmp_path):
    from keras_accel.adapter import choice_cache

    timed_ways(monkeypatch, plain=1e-3, compiled=1e-4, tmp_path=tmp_path)
    x, y = _data()
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
    acc.fit(_model(acc), x, y, batch_size=12, epochs=3, verbose=0)
    choice_cache.forget()  # As a new process: what the file holds.
    del ways_run[:]
    acc.fit(_model(acc), x, y, batch_size=12, epochs=1, verbose=0)  # A tuner's next trial.
    assert set(ways_run) == {"compiled"}  # No trial: XLA from its first group.


def test_an_interrupted_fit_leaves_the_model_as_it_was_and_the_rerun_trains(monkeypatch, ways_run):
    timed_ways(monkeypatch, plain=1e-3, compiled=1e-4)
    x, y = _data()
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
    model = _model(acc)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise KeyboardInterrupt  # A notebook's Ctrl-C, in the middle of the trial.

    with pytest.raises(KeyboardInterrupt):
        acc.fit(model, x, y, batch_size=12, epochs=3, verbose=0, callbacks=[Interrupt()])
    assert model.jit_compile is False
    history = acc.fit(model, x, y, batch_size=12, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert ways_run[-1] == "compiled"
    assert model.jit_compile is False
    assert acc.num_recompiles == 0
