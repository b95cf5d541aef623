"""Per-row random layers over replicas draw the global batch's numbers, as one device does
(JAX and TensorFlow; torch's processes: tests/adapter/test_torch.py), against plain
single-device Keras.

`Dropout(0.3, seed=5)` and `GaussianNoise(0.5, seed=2)` training 2 epochs on 45 rows in
batches of 8 (the last batch padded). JAX: one program on the global array draws one mask.
TensorFlow: each replica runs the layer on its own rows; from the same seed each would draw
the first rows' numbers (the global batch's mask of one device differs), so the layer runs
on the global batch's shape there (keras_accel.adapter.backends.tensorflow.reduction).
"""

import os

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.conftest import BACKEND

DEVICES = int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8"))
# The gradient's sum over replicas in another order: float32 rounding, amplified by 12 steps.
TOLERANCE = 1e-5

pytestmark = pytest.mark.skipif(BACKEND == "torch", reason="torch: tests/adapter/test_torch.py")


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
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(True))
    return model


def test_training_through_dropout_equals_one_device():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(45, 5)).astype("float32"), rng.integers(0, 3, 45)
    plain = _model()
    start = [w.copy() for w in plain.get_weights()]
    expected = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    acc = Accelerator(devices=DEVICES)
    with acc.scope():
        model = _model()
    for got, want in zip(model.get_weights(), start):
        np.testing.assert_array_equal(got, want)
    history = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected, rtol=0, atol=TOLERANCE)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


def test_the_custom_loop_through_dropout_equals_one_device():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(45, 5)).astype("float32"), rng.integers(0, 3, 45)
    plain = _model()
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    acc = Accelerator(devices=DEVICES)
    with acc.scope():
        model = _model()
    loop = acc.loop(model)
    for epoch in range(2):
        for batch in loop.batches(x, y, batch_size=8, epoch=epoch):
            loop.train_step(batch)
    for got, want in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
