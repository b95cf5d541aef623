"""One process of a torch run (or the one-process reference): every input kind through
`Accelerator.fit`, `evaluate` and `predict`. Usage: python _torch_inputs.py OUT.npz

The same seeded model (Dense, BatchNormalization, Dense; SGD with momentum) trains on 45
rows in global batches of 8 (the last batch holds 5 rows: padded, and uneven over 2
processes) from arrays, a generator, a tf.data.Dataset, a PyDataset and a torch DataLoader,
each from the same initial weights. Every process writes what it saw to OUT-<process>.npz.
"""

import contextlib
import sys

import keras
import numpy as np
import torch

from keras_accel import Accelerator
from keras_accel.adapter.backends.torch import collectives as torch_collectives
from keras_accel.adapter.backends.torch import metrics as torch_metrics

# Small buckets, so that the backward pass sends several while it goes on (the default 25
# MiB holds this whole model); each sent bucket is counted.
torch_collectives.BUCKET_BYTES = 64
SENT = [0]
_send = torch_collectives.GradientBuckets._send


def _counted(self, index):
    SENT[0] += 1
    return _send(self, index)


torch_collectives.GradientBuckets._send = _counted
# Every reduction of metric state (one collective per dtype), counted.
REDUCED = [0]
_reduced_values = torch_metrics.reduced_values


def _reduced(*args, **kwargs):
    REDUCED[0] += 1
    return _reduced_values(*args, **kwargs)


torch_metrics.reduced_values = _reduced
acc = Accelerator(seed=0)
rng = np.random.default_rng(0)
x = rng.normal(size=(45, 5)).astype("float32")
y = rng.integers(0, 3, 45).astype("int32")
BATCH = 8


def compiled(model):
    with acc.scope():
        model.compile(
            keras.optimizers.SGD(0.1, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


with acc.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )
start = [w.copy() for w in model.get_weights()]


def generator():
    for i in range(0, len(x), BATCH):
        yield x[i : i + BATCH], y[i : i + BATCH]


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return -(-len(x) // BATCH)

    def __getitem__(self, i):
        return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


def tf_dataset():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def loader():
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


inputs = {
    "arrays": lambda: (x, y),
    "generator": lambda: (generator(),),
    "pydataset": lambda: (Batches(),),
    "tfdata": lambda: (tf_dataset(),),
    "dataloader": lambda: (loader(),),
}


class BatchLogs(keras.callbacks.Callback):
    """Every batch's logs, training and validation, as a callback reads them."""

    def __init__(self):
        super().__init__()
        self.seen = {"train": [], "test": []}

    def on_train_batch_end(self, batch, logs=None):
        self.seen["train"].append([logs["loss"], logs["accuracy"]])

    def on_test_batch_end(self, batch, logs=None):
        self.seen["test"].append([logs["loss"], logs["accuracy"]])


out = {}
for name, make in inputs.items():
    model.set_weights(start)
    compiled(model)  # A fresh optimizer for each input.
    # A generator is read once: one epoch; the others two.
    epochs = 1 if name == "generator" else 2
    options = {"batch_size": BATCH, "shuffle": False} if name == "arrays" else {}
    REDUCED[0] = 0
    history = acc.fit(model, *make(), epochs=epochs, verbose=0, **options)
    out[f"reduced/{name}"] = np.asarray(REDUCED[0])
    out[f"{name}/loss"] = np.asarray(history.history["loss"])
    out[f"{name}/accuracy"] = np.asarray(history.history["accuracy"])
    for i, w in enumerate(model.get_weights()):
        out[f"{name}/w{i}"] = w
    if name in ("arrays", "dataloader"):
        evaluate = make() if name == "dataloader" else (x, y)
        options = {"batch_size": 7} if name == "arrays" else {}
        out[f"{name}/evaluate"] = np.asarray(acc.evaluate(model, *evaluate, verbose=0, **options))
        out[f"{name}/predict"] = acc.predict(model, x, batch_size=7, verbose=0)
out["sent_early"] = np.asarray(SENT[0])
# Batch logs read by the chief alone: every process reduces each step's metrics with it.
model.set_weights(start)
compiled(model)
logs = BatchLogs()
REDUCED[0] = 0
acc.fit(
    model,
    x,
    y,
    batch_size=BATCH,
    shuffle=False,
    epochs=2,
    validation_data=(x, y),
    callbacks=[logs] if acc.process_index == 0 else [],
    verbose=0,
)
out["reduced/read"] = np.asarray(REDUCED[0])
# And an evaluation's on its own, in batches of 7 (the last padded).
alone = BatchLogs()
acc.evaluate(
    model, x, y, batch_size=7, callbacks=[alone] if acc.process_index == 0 else [], verbose=0
)
if acc.process_index == 0:
    out["read/train"] = np.asarray(logs.seen["train"])
    out["read/test"] = np.asarray(logs.seen["test"])
    out["read/evaluate"] = np.asarray(alone.seen["test"])


class ExtraLogs(keras.Sequential):
    """A key of its own in each step's logs: Keras then reports the last step's logs as the
    epoch's, which must be the global batch's whether or not anything reads a step's."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return {**super().compute_metrics(x, y, y_pred, sample_weight), "extra": 1.0}


with acc.scope():
    extra = ExtraLogs(
        [
            keras.Input((5,)),
            *(keras.layers.deserialize(keras.layers.serialize(layer)) for layer in model.layers),
        ]
    )
extra.set_weights(start)
compiled(extra)
history = acc.fit(extra, x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0)
out["extra/loss"] = np.asarray(history.history["loss"])
out["extra/accuracy"] = np.asarray(history.history["accuracy"])


class Stop(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("stopped")


# A fit that ends in an error (in every process alike) leaves no answer behind.
with contextlib.suppress(RuntimeError):
    acc.fit(model, x, y, batch_size=BATCH, callbacks=[Stop()], verbose=0)
out["read/left"] = np.asarray(len(torch_metrics.LOGS_READ))
out["recompiles"] = np.asarray(acc.num_recompiles)
# Keras 3.16 wraps a model in DistributedDataParallel where a process group exists: never
# during the Accelerator's calls, which average the gradients themselves.
out["ddp_wrapped"] = np.asarray(getattr(model, "ddp_model", None) is not None)
np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **out)
