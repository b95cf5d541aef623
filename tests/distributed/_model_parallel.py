"""A JAX model-parallel run whose mesh spans processes (started by `keras-accel launch`).

Usage: python _model_parallel.py WORKDIR DATA,MODEL

Dense kernels are sharded over the "model" axis (the default layout map). With mesh 1 x 8
over 2 processes x 4 devices the model axis crosses the processes and the batch is not
split at all: every process feeds every row. Writes WORKDIR/result-<process>.npz.
"""

import os
import sys

import keras
import numpy as np

from keras_accel import Accelerator
from keras_accel.utils import keras_internals


def build_and_train(acc):
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(8),
            ]
        )
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 6)).astype("float32")
    y = rng.normal(size=(100, 8)).astype("float32")
    seen = ThreadSafety()
    history = acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0, callbacks=[seen])
    BUILT["threads_in_fit"] = seen.values
    return model, history.history["loss"], acc.predict(model, x, verbose=0)


BUILT: dict = {}


class ThreadSafety(keras.callbacks.Callback):
    """What Keras reads to decide whether batch-end callbacks may run in a thread pool
    (no batch hook here: that alone would make Keras run them in order)."""

    def __init__(self):
        super().__init__()
        self.values = []

    def on_epoch_end(self, epoch, logs=None):
        from keras_accel.utils import keras_internals

        self.values.append(keras_internals.backend_module().IS_THREAD_SAFE)


if __name__ == "__main__":
    workdir, mesh = sys.argv[1], tuple(int(v) for v in sys.argv[2].split(","))
    # Importing keras touches no device: the Accelerator still joins the cluster first.
    acc = Accelerator(strategy="model_parallel", mesh_shape=mesh, seed=0)
    model, losses, predictions = build_and_train(acc)
    # A kernel sharded over devices of both processes: each process holds half of it.
    from jax.experimental import multihost_utils

    gathered = [multihost_utils.process_allgather(v.value, tiled=True) for v in model.weights]
    np.savez(
        os.path.join(workdir, f"result-{acc.process_index}.npz"),
        loss=np.asarray(losses),
        predictions=predictions,
        spec=np.asarray(str(model.weights[0].value.sharding.spec)),
        threads_in_fit=np.asarray(BUILT["threads_in_fit"]),
        threads_after=np.asarray(keras_internals.backend_module().IS_THREAD_SAFE),
        **{f"w{i}": w for i, w in enumerate(gathered)},
    )
