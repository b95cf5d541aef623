"""A random layer of the user's draws one device's numbers on any number of replicas.

keras-io's VAE draws its latent noise in a layer of its own (`Sampling`: a
`keras.random.SeedGenerator` it holds, `keras.random.normal` of its input's shape). Where
each replica runs the model on its share of the batch (TensorFlow's replicas, torch's
processes), every replica drew from the same seed the numbers of the global batch's first
rows: the replicas' rows shared their noise, and the losses were plain Keras's to 0.4% only.
Such a layer (`global_rows.draws_of_its_own`) now draws on the global batch's shape, each
replica keeping its rows, as Keras's Dropout already did (torch's processes:
tests/adapter/test_torch_random.py; JAX's program sees the global batch)."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from keras_accel.adapter.backends.global_rows import draws_of_its_own
from tests.helpers import FEW_REPLICAS

ROWS, BATCH = 40, 8


class Sampling(keras.layers.Layer):
    """keras-io's VAE's: z from (z_mean, z_log_var), its own seed generator, no `training`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def _model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    z_mean = keras.layers.Dense(3)(inputs)
    z_log_var = keras.layers.Dense(3)(inputs)
    z = Sampling()([z_mean, z_log_var])
    model = keras.Model(inputs, keras.layers.Dense(1)(z))
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def test_a_layer_of_the_users_that_holds_a_seed_generator_is_found():
    model = _model()
    found = [type(layer).__name__ for layer in model.layers if draws_of_its_own(layer)]
    assert found == ["Sampling"]  # Not Keras's own layers, nor the model.


@pytest.mark.torch
def test_a_random_layer_of_the_users_draws_one_devices_numbers(backend, num_devices):
    devices = FEW_REPLICAS if backend == "tensorflow" else num_devices
    acc = Accelerator(seed=0, devices=devices)
    with acc.scope():
        ours = _model()
    plain = _model()
    plain.set_weights(ours.get_weights())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    keras.utils.set_random_seed(5)
    want = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(5)
    got = acc.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
