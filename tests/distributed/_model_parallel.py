"""A JAX model-parallel run whose mesh spans processes (started by `keras-accel launch`).

Usage: python _model_parallel.py WORKDIR DATA,MODEL [STRATEGY]

STRATEGY is "model_parallel" (the default) or "fsdp". Under model_parallel Dense kernels are
sharded over the "model" axis (the default layout map): with mesh 1 x 8 over 2 processes x 4
devices the model axis crosses the processes and the batch is not split at all, every
process feeds every row. Under fsdp with mesh 8 x 1 every variable is split over the data
axis, which crosses the processes: each process holds half of every kernel and feeds half
of every batch. Writes WORKDIR/result-<process>.npz, and through ModelCheckpoint (every epoch,
the chief writing) WORKDIR/weights.weights.h5 and WORKDIR/model.keras: Keras's savers read
variables that no process holds whole.
"""

import os
import sys
import threading

import keras
import numpy as np

from keras_accel import Accelerator


def build_and_train(acc, callbacks=()):
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
    seen = BatchEndThreads()
    history = acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0, callbacks=[seen, *callbacks])
    BUILT["threads_in_fit"] = seen.values
    return model, history.history["loss"], acc.predict(model, x, verbose=0)


BUILT: dict = {}


class BatchEndThreads(keras.callbacks.Callback):
    """Whether each training batch end ran on the main thread. `async_safe`: Keras leaves
    this callback out of its decision to run batch ends in a thread pool, so the decision
    is what the other callbacks (the Accelerator's) make it."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(threading.current_thread() is threading.main_thread())


if __name__ == "__main__":
    workdir, mesh = sys.argv[1], tuple(int(v) for v in sys.argv[2].split(","))
    strategy = sys.argv[3] if len(sys.argv) > 3 else "model_parallel"
    # Importing keras touches no device: the Accelerator still joins the cluster first.
    acc = Accelerator(strategy=strategy, mesh_shape=mesh, seed=0)
    from keras_accel.callbacks import ModelCheckpoint

    checkpoints = [
        ModelCheckpoint(os.path.join(workdir, "weights.weights.h5"), save_weights_only=True),
        ModelCheckpoint(os.path.join(workdir, "model.keras")),
    ]
    model, losses, predictions = build_and_train(acc, callbacks=checkpoints)
    # A kernel sharded over devices of both processes: each process holds half of it.
    from jax.experimental import multihost_utils

    gathered = [multihost_utils.process_allgather(v.value, tiled=True) for v in model.weights]
    np.savez(
        os.path.join(workdir, f"result-{acc.process_index}.npz"),
        loss=np.asarray(losses),
        predictions=predictions,
        spec=np.asarray(str(model.weights[0].value.sharding.spec)),
        shards=np.asarray([len(v.value.addressable_shards) for v in model.weights]),
        threads_in_fit=np.asarray(BUILT["threads_in_fit"]),
        thread_safe=np.asarray(vars(sys.modules["keras.src.backend"])["IS_THREAD_SAFE"]),
        **{f"w{i}": w for i, w in enumerate(gathered)},
    )
