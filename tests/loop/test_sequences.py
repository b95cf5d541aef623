"""`acc.loop` on sequence targets (a loss per time step) on uneven data: per-step weights
and a Keras mask (`Embedding(mask_zero=True)`) reach the loss and the metrics, the padded
last batch counts nowhere, and every replica count gives one device's numbers. Before, a
per-step weight `(rows, steps)` met the per-example loss `(rows,)` and every backend
crashed."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.conftest import NUM_DEVICES
from tests.helpers import assert_weights_close

pytestmark = pytest.mark.torch

ROWS, BATCH, STEPS, VOCAB, CLASSES = 21, 8, 6, 12, 4


def _data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, (ROWS, STEPS))
    lengths = rng.integers(2, STEPS + 1, ROWS)
    tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0
    tags = rng.integers(0, CLASSES, (ROWS, STEPS))
    weights = rng.uniform(0.5, 2.0, (ROWS, STEPS)).astype("float32")
    return tokens, tags, weights


def _loop(acc):
    with acc.scope():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((STEPS,), dtype="int32")
        hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
        return acc.loop(
            model,
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("weighted_accuracy")],
        )


def _trained(devices):
    tokens, tags, weights = _data()
    loop = _loop(Accelerator(devices=devices, seed=0))
    logs = []
    for epoch in range(2):
        loop.reset_metrics()
        for batch in loop.batches(tokens, tags, BATCH, sample_weight=weights, epoch=epoch):
            loop.train_step(batch)
        logs.append(loop.results())
    return loop, logs


def test_the_loss_is_the_mean_over_rows_of_each_rows_unmasked_steps():
    tokens, tags, weights = _data()
    loop, _ = _trained(NUM_DEVICES)
    got = loop.evaluate(tokens, tags, batch_size=BATCH, sample_weight=weights)
    logits = keras.ops.convert_to_numpy(loop.model(tokens, training=False))
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    step_losses = -np.take_along_axis(log_probs, tags[..., None], -1)[..., 0]
    unmasked = tokens != 0
    rows = (step_losses * weights * unmasked).sum(1) / unmasked.sum(1)
    np.testing.assert_allclose(got["loss"], rows.mean(), rtol=1e-5)
    hits = logits.argmax(-1) == tags
    np.testing.assert_allclose(got["accuracy"], hits[unmasked].mean(), rtol=1e-5)
    counted = weights * unmasked
    np.testing.assert_allclose(
        got["weighted_accuracy"], (hits * counted).sum() / counted.sum(), rtol=1e-5
    )


@pytest.mark.skipif(NUM_DEVICES == 1, reason="one device is the reference")
def test_every_replica_count_gives_one_devices_numbers():
    many, many_logs = _trained(NUM_DEVICES)
    one, one_logs = _trained(1)
    for got, want in zip(many_logs, one_logs):
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
    assert_weights_close(many.model.get_weights(), one.model.get_weights())
