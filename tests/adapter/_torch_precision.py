"""One process of a torch run under a mixed-precision policy (or the one-process
reference). Usage: python _torch_precision.py POLICY OUT

45 rows in batches of 8 (the last padded, uneven over 2 processes), BatchNormalization, SGD;
under "float16" the optimizer is Keras's LossScaleOptimizer, whose skip-or-apply decision
reads the averaged gradients. Writes OUT-<process>.npz."""

import sys

import keras
import numpy as np

from keras_accel import Accelerator

policy, out = sys.argv[1], sys.argv[2]
acc = Accelerator(seed=0, mixed_precision=policy)
rng = np.random.default_rng(0)
x = rng.normal(size=(45, 5)).astype("float32")
y = rng.integers(0, 3, 45)
with acc.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
            keras.layers.Activation("linear", dtype="float32"),
        ]
    )
    model.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
history = acc.fit(model, x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
np.savez(
    f"{out}-{acc.process_index}.npz",
    loss=np.asarray(history.history["loss"]),
    evaluation=np.asarray(acc.evaluate(model, x, y, batch_size=8, verbose=0)),
    optimizer=np.asarray(type(model.optimizer).__name__),
    **{f"w{i}": w for i, w in enumerate(model.get_weights())},
)
