"""One process of a torch fsdp run (or the one-process reference). Usage:
python _torch_fsdp.py OUT STRATEGY

37 rows in global batches of 8 (the last batch holds 5 rows: padded), a 3-layer MLP with
BatchNormalization and Dropout (the global batch's mask, drawn by a seed generator whose
state FSDP2 must leave whole), trained 2 epochs with SGD (momentum) and with Adam,
validated on 13 rows after each epoch (a call inside the call), then evaluated and asked
for every prediction; then a fit whose ModelCheckpoint reads the weights inside the call. During
each fit a callback records, at each batch's end, the local shapes of the variables and
the optimizer's slots this process holds. Every process writes what it saw to
OUT-<process>.npz.
"""

import sys

import keras
import numpy as np

from keras_accel import Accelerator

OUT, STRATEGY = sys.argv[1], sys.argv[2]


def mlp():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(6, activation="relu"),
            keras.layers.Dropout(0.3, seed=5),
            keras.layers.Dense(3),
        ]
    )


class HeldShapes(keras.callbacks.Callback):
    """The local shape each variable and slot has in this process, between steps."""

    def __init__(self):
        super().__init__()
        self.shapes = {}

    def on_train_batch_end(self, batch, logs=None):
        from torch.distributed.tensor import DTensor

        def local(variable):
            value = variable.value
            return tuple((value.to_local() if isinstance(value, DTensor) else value).shape)

        for v in self.model.weights:
            self.shapes[f"var/{v.path}"] = local(v)
        for v in self.model.optimizer.variables:
            if len(v.shape):
                self.shapes[f"slot/{v.path}"] = local(v)


acc = Accelerator(strategy=STRATEGY, seed=0)
rng = np.random.default_rng(0)
x = rng.normal(size=(37, 6)).astype("float32")
y = rng.normal(size=(37, 3)).astype("float32")
out = {}
for name, optimizer in (
    ("sgd", lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    ("adam", lambda: keras.optimizers.Adam(0.01)),
):
    keras.utils.set_random_seed(0)
    with acc.scope():
        model = mlp()
        model.compile(optimizer=optimizer(), loss="mse", metrics=["mae"])
    held = HeldShapes()
    history = acc.fit(
        model,
        x,
        y,
        batch_size=8,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[held],
        validation_data=(x[:13], y[:13]),
    )
    out[f"{name}/loss"] = np.asarray(history.history["loss"])
    out[f"{name}/mae"] = np.asarray(history.history["mae"])
    out[f"{name}/val_loss"] = np.asarray(history.history["val_loss"])
    for i, w in enumerate(model.get_weights()):
        out[f"{name}/w{i}"] = w
    for i, w in enumerate(v.numpy() for v in model.optimizer.variables if len(v.shape)):
        out[f"{name}/slot{i}"] = w
    out[f"{name}/evaluate"] = np.asarray(acc.evaluate(model, x, y, batch_size=8, verbose=0))
    out[f"{name}/predict"] = acc.predict(model, x, batch_size=8, verbose=0)
    for key, shape in held.shapes.items():
        out[f"{name}/held/{key}"] = np.asarray(shape)
    out[f"{name}/class"] = np.asarray(type(model.weights[0]).__name__)
# A callback that reads the weights inside the call: refused in our words under fsdp.
checkpoint = keras.callbacks.ModelCheckpoint(
    f"{OUT}-{acc.process_index}.weights.h5", save_weights_only=True
)
try:
    acc.fit(model, x, y, batch_size=8, epochs=1, verbose=0, callbacks=[checkpoint])
    out["checkpoint"] = np.asarray("saved")
except ValueError as error:
    out["checkpoint"] = np.asarray(str(error))
out["after_checkpoint"] = model.get_weights()[0]  # Whole again after the failed call.
np.savez(f"{OUT}-{acc.process_index}.npz", **out)
