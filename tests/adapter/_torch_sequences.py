"""One process of a torch run (or the one-process reference) of a token tagger on uneven
data: a loss per time step under a Keras mask (`Embedding(mask_zero=True)`), per-step
weights; fit, evaluate and the custom loop. Usage: python _torch_sequences.py OUT

21 rows in global batches of 8: the last batch holds 5 rows (padded; 4 real rows in process
0, 1 in process 1), and the processes' unmasked steps differ in every batch, so the loss is
one process's only if the mean over unmasked steps is counted over both processes. A
second tagger's loss is a sum (`reduction="sum"`), which must add both processes' sums; a
third's divides by its weights' sum (`reduction="mean_with_sample_weight"`), the global
batch's.

Every process writes what it saw to OUT-<process>.npz.
"""

import sys

import keras
import numpy as np

from keras_accel import Accelerator

ROWS, BATCH, STEPS, VOCAB, CLASSES = 21, 8, 6, 12, 4

acc = Accelerator(seed=0)
rng = np.random.default_rng(0)
tokens = rng.integers(1, VOCAB, (ROWS, STEPS))
lengths = rng.integers(2, STEPS + 1, ROWS)
tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
tags = rng.integers(0, CLASSES, (ROWS, STEPS))
weights = rng.uniform(0.5, 2.0, (ROWS, STEPS)).astype("float32")

with acc.scope():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        weighted_metrics=["accuracy"],
    )

out = {}
for name, kwargs in (("plain", {}), ("weighted", {"sample_weight": weights})):
    history = acc.fit(
        model, tokens, tags, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **kwargs
    )
    for key, values in history.history.items():
        out[f"{name}/fit/{key}"] = np.asarray(values)
    evaluated = acc.evaluate(
        model, tokens, tags, batch_size=BATCH, verbose=0, return_dict=True, **kwargs
    )
    for key, value in evaluated.items():
        out[f"{name}/evaluate/{key}"] = np.asarray(value)
for i, weight in enumerate(model.get_weights()):
    out[f"w{i}"] = weight

# A summed loss under the mask: the unmasked steps' values added over both processes
# (each process's gradient of its own sum is averaged, so each counts its sum twice).
with acc.scope():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    summed = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    summed.compile(
        keras.optimizers.SGD(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
    )
history = acc.fit(summed, tokens, tags, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
out["sum/fit/loss"] = np.asarray(history.history["loss"])
out["sum/evaluate/loss"] = np.asarray(
    acc.evaluate(summed, tokens, tags, batch_size=BATCH, verbose=0)
)
for i, weight in enumerate(summed.get_weights()):
    out[f"sum/w{i}"] = weight

# A loss divided by its weights' sum (the mask's times the per-step weights): each process
# divides by its own, unless made its share of the global quotient.
with acc.scope():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    divided = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    divided.compile(
        keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"
        ),
    )
fit = dict(batch_size=BATCH, sample_weight=weights, verbose=0)
history = acc.fit(divided, tokens, tags, epochs=2, shuffle=False, **fit)
out["divided/fit/loss"] = np.asarray(history.history["loss"])
out["divided/evaluate/loss"] = np.asarray(acc.evaluate(divided, tokens, tags, **fit))
for i, weight in enumerate(divided.get_weights()):
    out[f"divided/w{i}"] = weight

# The custom loop: each row's loss the mean over its unmasked steps, per-step weights.
with acc.scope():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    loop = acc.loop(
        keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden)),
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("weighted_accuracy")],
    )
for epoch in range(2):
    loop.reset_metrics()
    for batch in loop.batches(tokens, tags, BATCH, sample_weight=weights, epoch=epoch):
        loop.train_step(batch)
    for key, value in loop.results().items():
        out[f"loop/{epoch}/{key}"] = np.asarray(value)
for i, weight in enumerate(loop.model.get_weights()):
    out[f"loop/w{i}"] = weight

np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **out)
