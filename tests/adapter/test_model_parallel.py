"""model_parallel: a (batch, model) mesh on JAX; a clear error on TensorFlow."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import assert_weights_close, data


def _model():
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu", name="dense_in"),
            keras.layers.Dense(8, activation="softmax", name="dense_out"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


def test_model_parallel_shards_dense_kernels_and_trains_as_one_device(backend):
    if backend != "jax":
        with pytest.raises(ValueError, match="needs the JAX backend"):
            Accelerator(strategy="model_parallel", mesh_shape=(2, 4))
        return
    acc = Accelerator(strategy="model_parallel", mesh_shape=(2, 4), seed=0)
    assert acc.num_replicas == 2 and acc.mesh_shape == (2, 4)
    with acc.scope():
        model = _model()
    twin = _model()  # one device, the same initial weights
    twin.set_weights(model.get_weights())
    kernel = model.layers[0].kernel.value
    shard_shapes = {tuple(s.data.shape) for s in kernel.addressable_shards}
    assert shard_shapes == {(6, 4)}  # 16 output units over a model axis of 4
    # 37 rows in batches of 8: the last batch has 5 real rows, padded over the batch axis.
    x, y = data(37)
    history = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    assert_weights_close(model.get_weights(), twin.get_weights())
    assert history.history["loss"][1] < history.history["loss"][0]  # it did train
    np.testing.assert_allclose(
        acc.predict(model, x, batch_size=8, verbose=0), twin.predict(x, verbose=0), atol=1e-5
    )
