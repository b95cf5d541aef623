"""One process of a torch run for keras-io's models whose losses the model's own code
computes, and an Embedding on `ops.arange`: each process trains the model through
`Accelerator.fit` and a plain Keras twin on the whole data itself, from the same weights.
Usage: python _torch_losses.py OUT; every process writes OUT-<process>.npz.

- keras-io's Distiller (a class's own `compute_loss` of two Keras loss objects it holds, a
  mean of its own; tests/adapter/test_losses_and_gradients.py), SGD;
- keras-io's endpoint layer (`add_loss` of a Keras loss object it holds), SGD;
- keras-io's transformer's token and position embeddings, Adam.

64 and 32 rows in batches of 16: nothing padded, which such code could not weight out.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from tests.adapter.test_losses_and_gradients import (  # noqa: E402
    Distiller,
    LogisticEndpoint,
    TokenAndPosition,
    _dense,
)
from tests.helpers import data  # noqa: E402


def distiller():
    model = Distiller(_dense(0, 3), _dense(5, 3))
    model.compile(
        keras.optimizers.SGD(0.5),
        [keras.metrics.SparseCategoricalAccuracy()],
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )
    return model


def endpoint():
    inputs = keras.Input((6,), name="inputs")
    targets = keras.Input((1,), name="targets")
    logits = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))(inputs)
    model = keras.Model([inputs, targets], LogisticEndpoint(name="predictions")(logits, targets))
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    return model


def embedding():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(TokenAndPosition(5, 11, 4)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(3)(hidden))
    model.compile(
        keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


acc = Accelerator(seed=0)
x, y = data(64)
rng = np.random.default_rng(0)
tokens, labels = rng.integers(0, 11, (32, 5)).astype("int32"), rng.integers(0, 3, 32)
cases = {
    "distiller": (distiller, (x, y)),
    "endpoint": (endpoint, ({"inputs": x, "targets": (y > 0).astype("float32")[:, None]},)),
    "embedding": (embedding, (tokens, labels)),
}
out = {}
for name, (make, arrays) in cases.items():
    with acc.scope():
        ours = make()
    twin = make()
    if name == "distiller":
        ours(x[:2]), twin(x[:2])
    twin.set_weights(ours.get_weights())
    fit = dict(batch_size=16, epochs=2, shuffle=False, verbose=0)
    history = acc.fit(ours, *arrays, **fit).history
    expected = twin.fit(*arrays, **fit).history
    for key in expected:
        out[f"{name}/{key}"] = history[key]
        out[f"{name}/{key}/one"] = expected[key]
    out[f"{name}/weights"] = max(
        float(np.abs(a - b).max()) for a, b in zip(ours.get_weights(), twin.get_weights())
    )
np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **{k: np.asarray(v) for k, v in out.items()})
