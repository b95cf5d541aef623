"""On one TensorFlow device a model compiled with `jit_compile=True` runs each fused group of
steps as one XLA program (`keras_accel.adapter.backends.tensorflow.fused._XlaGroup`) instead
of one XLA launch per step: every number must be the one the per-step launches give."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's fused steps"
)


def _run(monkeypatch, grouped: bool, dropout: bool, rows: int, spe):
    from keras_accel.adapter.backends.tensorflow import fused

    calls = []
    takes = fused._XlaGroup.takes

    def spy(self, spec, n):
        taken = grouped and takes(self, spec, n)
        calls.append(taken)
        return taken

    monkeypatch.setattr(fused._XlaGroup, "takes", spy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 12)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 5, rows), 5)
    keras.utils.set_random_seed(1)
    acc = Accelerator(seed=0, devices=1, steps_per_execution=spe)
    with acc.scope():
        layers = [keras.Input((12,)), keras.layers.Dense(16, activation="relu")]
        if dropout:
            layers.append(keras.layers.Dropout(0.3))
        model = keras.Sequential([*layers, keras.layers.Dense(5, activation="softmax")])
        model.compile(
            keras.optimizers.Adam(1e-2),
            "categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=True,
        )
    history = acc.fit(
        model, x, y, batch_size=16, epochs=2, verbose=0, validation_data=(x[:40], y[:40])
    )
    evaluation = acc.evaluate(model, x, y, batch_size=16, verbose=0)
    monkeypatch.undo()
    return model.get_weights(), history.history, evaluation, calls


@pytest.mark.parametrize("dropout,rows,spe", [(False, 200, "auto"), (True, 200, 4), (False, 64, 3)])
def test_xla_groups_compute_what_per_step_launches_do(monkeypatch, dropout, rows, spe):
    weights, history, evaluation, calls = _run(monkeypatch, True, dropout, rows, spe)
    assert calls and all(calls)  # The groups ran as one XLA program each.
    want_weights, want_history, want_evaluation, _ = _run(monkeypatch, False, dropout, rows, spe)
    assert history == want_history
    assert evaluation == want_evaluation
    for got, want in zip(weights, want_weights):
        np.testing.assert_array_equal(got, want)


def test_large_groups_and_replicas_keep_per_step_launches():
    import tensorflow as tf

    from keras_accel.adapter.backends.tensorflow import fused

    one = fused._XlaGroup(None, None, tf.distribute.get_strategy(), None)
    spec = (tf.TensorSpec([64, 32]), tf.TensorSpec([64, 10]))
    assert one.takes(spec, 32)
    assert not one.takes((tf.TensorSpec([4096, 32, 32, 3]),), 32)  # 1.5 GiB a group.
    assert not one.takes((tf.TensorSpec([None, 32]),), 32)
    assert not one.takes((tf.TensorSpec([64], tf.string),), 32)
