"""One process of a torch run with unseeded and seeded Dropout through the Accelerator,
for tests/adapter/test_torch_random.py, which runs the same calls in plain Keras (its
`_plain`). Usage: python _torch_random.py OUT [plain] (plain: plain Keras here).

45 rows in batches of 8 (the last batch: 5 real rows, padded to 8 by the Accelerator; over
2 processes 4 real rows in process 0 and 1 in process 1), 3 epochs with validation data,
then `evaluate` and `predict`, all without shuffling. Every process writes its history,
weights, evaluation, predictions and torch's generator's state after each call to
OUT-<process>.npz.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.helpers import Noise  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(45, 5)).astype("float32")
y = rng.integers(0, 3, 45).astype("int32")
x_val = rng.normal(size=(13, 5)).astype("float32")
y_val = rng.integers(0, 3, 13).astype("int32")
PLAIN = sys.argv[2:] == ["plain"]


def build():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16),
            keras.layers.Dropout(0.5),  # Unseeded: torch's global generator.
            keras.layers.Reshape((8, 2)),
            # A conv's output is laid out channels-first in memory (strides (C*L, 1, L)),
            # which an unseeded Dropout draws its mask in.
            keras.layers.Conv1D(4, 3, padding="same"),
            keras.layers.Dropout(0.5),
            keras.layers.Flatten(),
            Noise(),  # A random layer of the user's: its own seed generator.
            keras.layers.Dense(16),
            keras.layers.Dropout(0.3, seed=5),  # Seeded: its own seed generator.
            keras.layers.Dense(3),
        ]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"])
    return model


if PLAIN:
    model, index = build(), 0
    fit, evaluate, predict = model.fit, model.evaluate, model.predict
else:
    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    with acc.scope():
        model = build()
    index = acc.process_index
    fit, evaluate, predict = (
        lambda *a, **k: acc.fit(model, *a, **k),
        lambda *a, **k: acc.evaluate(model, *a, **k),
        lambda *a, **k: acc.predict(model, *a, **k),
    )
out = {}
keras.utils.set_random_seed(7)
history = fit(
    x, y, batch_size=8, epochs=3, shuffle=False, validation_data=(x_val, y_val), verbose=0
)
out.update({f"fit/{k}": np.asarray(v) for k, v in history.history.items()})
out.update({f"fit/w{i}": w for i, w in enumerate(model.get_weights())})
out["fit/rng"] = torch.get_rng_state().numpy()
out["evaluate"] = np.asarray(evaluate(x, y, batch_size=6, verbose=0))
out["evaluate/rng"] = torch.get_rng_state().numpy()
out["predict"] = predict(x, batch_size=8, verbose=0)
out["predict/rng"] = torch.get_rng_state().numpy()
np.savez(f"{sys.argv[1]}-{index}.npz", **out)
