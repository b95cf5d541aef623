"""On one TensorFlow CPU device a long call of a model Keras left without XLA runs its steps
as XLA groups (`keras_accel.adapter.backends.tensorflow.xla.auto`): faster there, the same
numbers up to float rounding, the model's `jit_compile` as it was once the call returns, and
never where XLA was measured slower or its choice is not ours to make."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's XLA on a CPU"
)


@pytest.fixture
def groups_run(monkeypatch):
    """Counts the XLA group programs run (`fused._XlaGroup.run_group`); the threshold of
    `xla.auto` at 40 steps, so that these small runs cross it."""
    from keras_accel.adapter.backends.tensorflow import fused, xla

    calls = []
    run_group = fused._XlaGroup.run_group

    def spy(self, iterator):
        calls.append(1)
        return run_group(self, iterator)

    monkeypatch.setattr(fused._XlaGroup, "run_group", spy)
    monkeypatch.setattr(xla, "AUTO_AFTER_STEPS", 40)
    return calls


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
            layers.append(keras.layers.Dense(16, activation="relu"))
            if kind == "dropout":
                layers.append(keras.layers.Dropout(0.3))
            model = keras.Sequential([*layers, keras.layers.Dense(5, activation="softmax")])
        model.compile(
            keras.optimizers.Adam(1e-2),
            "categorical_crossentropy",
            metrics=["accuracy"],
            **compile_kwargs,
        )
    return model


def test_a_long_fit_runs_xla_groups_with_plain_kerass_numbers_and_leaves_no_trace(
    groups_run, capsys
):
    x, y = _data()
    acc = Accelerator(seed=0, devices=1)
    model = _model(acc)
    assert model.jit_compile is False  # Keras's "auto" on a CPU-only machine.
    # 16 batches an epoch (one of 12 rows) over 3 epochs: 48 steps, past the threshold.
    history = acc.fit(
        model, x, y, batch_size=12, epochs=3, validation_data=(x, y), shuffle=False, verbose=1
    )
    assert groups_run  # The steps ran as XLA groups,
    assert model.jit_compile is False  # and the model is as it was.
    assert "runs its steps with XLA" in capsys.readouterr().out

    reference = _model(Accelerator(seed=0, devices=1))
    want = reference.fit(
        x, y, batch_size=12, epochs=3, validation_data=(x, y), shuffle=False, verbose=0
    )
    got_weights, want_weights = model.get_weights(), reference.get_weights()
    for got, expected in zip(got_weights, want_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    for key, values in want.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-4, atol=1e-5)

    # Its later calls keep XLA, an evaluation's too, and nothing is counted as a recompile.
    before = len(groups_run)
    acc.fit(model, x, y, batch_size=12, epochs=1, verbose=0)
    acc.evaluate(model, x, y, batch_size=12, verbose=0)
    assert len(groups_run) > before
    assert acc.num_recompiles == 0
    assert model.jit_compile is False


def test_the_switch_after_short_calls_is_not_a_recompile(groups_run):
    x, y = _data()
    acc = Accelerator(seed=0, devices=1)
    model = _model(acc)
    acc.fit(model, x, y, batch_size=12, epochs=1, verbose=0)  # 16 steps: no XLA.
    acc.evaluate(model, x, y, batch_size=12, verbose=0)
    assert not groups_run
    acc.fit(model, x, y, batch_size=12, epochs=2, verbose=0)  # 16 + 32: XLA from here.
    assert groups_run
    assert acc.num_recompiles == 0


@pytest.mark.parametrize(
    "case",
    [
        "short",
        "dropout",
        "conv",
        "subclassed",
        "off_by_env",
        "steps_per_epoch",
        "replicas",
        "eager",
    ],
)
def test_xla_stays_off_where_it_was_not_measured_faster_or_is_not_ours(
    groups_run, monkeypatch, case
):
    x, y = _data()
    acc = Accelerator(seed=0, devices=2 if case == "replicas" else 1)
    kind = case if case in ("dropout", "conv", "subclassed") else "dense"
    model = _model(acc, kind, run_eagerly=case == "eager")
    if case == "off_by_env":
        monkeypatch.setenv("KERAS_ACCEL_TF_XLA", "0")
    kwargs = {"steps_per_epoch": 16} if case == "steps_per_epoch" else {}
    epochs = 1 if case == "short" else 3
    acc.fit(model, x, y, batch_size=12, epochs=epochs, verbose=0, **kwargs)
    assert not groups_run
    assert model.jit_compile is False


def test_an_interrupted_fit_leaves_jit_compile_as_it_was_and_the_rerun_trains(groups_run):
    x, y = _data()
    acc = Accelerator(seed=0, devices=1)
    model = _model(acc)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise KeyboardInterrupt  # A notebook's Ctrl-C, inside the XLA call.

    with pytest.raises(KeyboardInterrupt):
        acc.fit(model, x, y, batch_size=12, epochs=3, verbose=0, callbacks=[Interrupt()])
    assert groups_run
    assert model.jit_compile is False
    history = acc.fit(model, x, y, batch_size=12, epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert model.jit_compile is False
    assert acc.num_recompiles == 0
