"""model_parallel: a (batch, model) mesh on JAX; a clear error on TensorFlow."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import data


def test_model_parallel_shards_dense_kernels(backend):
    if backend != "jax":
        with pytest.raises(ValueError, match="needs the JAX backend"):
            Accelerator(strategy="model_parallel", mesh_shape=(2, 4))
        return
    acc = Accelerator(strategy="model_parallel", mesh_shape=(2, 4), seed=0)
    assert acc.num_replicas == 2 and acc.mesh_shape == (2, 4)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu", name="dense_in"),
                keras.layers.Dense(8, name="dense_out"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    kernel = model.layers[0].kernel.value
    shard_shapes = {tuple(s.data.shape) for s in kernel.addressable_shards}
    assert shard_shapes == {(6, 4)}  # 16 output units over a model axis of 4
    x, y = data(37)
    history = acc.fit(model, x, y, batch_size=8, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert acc.predict(model, x, batch_size=8, verbose=0).shape == (37, 8)
