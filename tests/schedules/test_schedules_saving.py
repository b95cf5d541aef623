"""Configs round-trip, schedules survive `model.save`, and drive a real `model.fit`."""

import json

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel.schedules import (
    Constant,
    CosineDecay,
    ExponentialDecay,
    Join,
    LinearDecay,
    PiecewiseConstant,
    Warmup,
    WarmupCosine,
    WarmupLinear,
)

# Backend-generic: the torch run takes these too (tests/conftest.py).
pytestmark = pytest.mark.torch

STEPS = np.arange(24)


def examples():
    return {
        "constant": Constant(1e-3),
        "piecewise_fraction": PiecewiseConstant(
            [1e-3, 1e-4], boundaries=[0.5], unit="fraction", total_steps=20
        ),
        "piecewise_epochs": PiecewiseConstant(
            [1e-3, 1e-4, 1e-5], boundaries=[1, 2.5], unit="epochs", steps_per_epoch=4
        ),
        "exponential": ExponentialDecay(1e-2, decay_steps=5, decay_rate=0.5, end_value=1e-4),
        "cosine": CosineDecay(1e-3, end_value=1e-5, total_steps=20),
        "linear": LinearDecay(1e-3, total_steps=20),
        "warmup_cosine": WarmupCosine(1e-3, warmup_fraction=0.1, end_value=1e-5, total_steps=20),
        "warmup_linear": WarmupLinear(1e-3, warmup_steps=3, total_steps=20),
        "warmup_keras_schedule": Warmup(
            keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=5, decay_rate=0.5),
            warmup_steps=4,
        ),
        "join_nested": Join(
            [
                WarmupLinear(1e-3, warmup_steps=2),
                Warmup(CosineDecay(1e-3), warmup_fraction=0.2),
            ],
            boundaries=[0.25],
            unit="fraction",
            total_steps=20,
        ),
    }


def values(schedule):
    return ops.convert_to_numpy(schedule(STEPS))


@pytest.mark.parametrize("name", sorted(examples()))
def test_get_config_from_config_round_trip(name):
    schedule = examples()[name]
    config = schedule.get_config()
    config = json.loads(json.dumps(config))  # the config must be plain JSON
    restored = type(schedule).from_config(config)
    assert type(restored) is type(schedule)
    assert restored.get_config() == config
    np.testing.assert_allclose(values(restored), values(schedule), rtol=1e-6)


@pytest.mark.parametrize("name", sorted(examples()))
def test_keras_serialization_finds_the_registered_class(name):
    schedule = examples()[name]
    serialized = keras.saving.serialize_keras_object(schedule)
    assert serialized["registered_name"] == f"keras_accel>{type(schedule).__name__}"
    restored = keras.saving.deserialize_keras_object(json.loads(json.dumps(serialized)))
    assert type(restored) is type(schedule)
    np.testing.assert_allclose(values(restored), values(schedule), rtol=1e-6)


def test_bound_copy_keeps_its_length_through_config():
    bound = WarmupCosine(1e-3, warmup_fraction=0.1).with_total_steps(50)
    restored = WarmupCosine.from_config(bound.get_config())
    assert restored.total_steps == 50 and not restored.needs_total_steps


def test_optimizer_config_round_trip():
    schedule = examples()["join_nested"]
    optimizer = keras.optimizers.Adam(learning_rate=schedule)
    restored = keras.optimizers.Adam.from_config(optimizer.get_config())
    assert restored.get_config()["learning_rate"] == optimizer.get_config()["learning_rate"]
    # Both optimizers are at iteration 0: the restored schedule gives the same first rate.
    np.testing.assert_allclose(
        ops.convert_to_numpy(restored.learning_rate), float(schedule(0)), rtol=1e-6
    )


def tiny_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")).astype("float32")
    return x, y


def tiny_model(learning_rate):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=learning_rate), loss="mse")
    return model


class _RecordLearningRate(keras.callbacks.Callback):
    """Reads the rate the optimizer will use for each batch (the compiled step uses the same)."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(float(ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def test_fit_with_a_schedule_as_learning_rate():
    # The seed's "x0.1 at 50% of training": 2 epochs of 4 batches, so the drop is at step 4.
    schedule = PiecewiseConstant([0.1, 0.01], boundaries=[0.5], unit="fraction", total_steps=8)
    x, y = tiny_data()
    model = tiny_model(schedule)
    recorder = _RecordLearningRate()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[recorder])
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) == 8
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < history.history["loss"][0]
    # After the update of step i, iterations is i + 1: the rate shown is the next step's.
    np.testing.assert_allclose(recorder.rates, [0.1] * 3 + [0.01] * 5, rtol=1e-6)


def test_model_save_and_load_keep_the_schedule(tmp_path):
    schedule = WarmupCosine(0.05, warmup_steps=2, end_value=1e-3, total_steps=8)
    x, y = tiny_data()
    model = tiny_model(schedule)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)

    loaded = keras.saving.load_model(path)
    saved_rate = loaded.optimizer.get_config()["learning_rate"]
    assert saved_rate["registered_name"] == "keras_accel>WarmupCosine"
    assert saved_rate["config"] == schedule.get_config()
    # The step count is restored too, so the loaded optimizer resumes at the same rate.
    assert int(ops.convert_to_numpy(loaded.optimizer.iterations)) == 4
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded.optimizer.learning_rate), float(schedule(4)), rtol=1e-6
    )
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_allclose(
        ops.convert_to_numpy(loaded.optimizer.learning_rate), 1e-3, rtol=1e-5
    )
