"""`acc.loop` on sequence targets (a loss per time step) on uneven data: per-step weights
and a Keras mask (`Embedding(mask_zero=True)`) reach the loss and the metrics, the padded
last batch counts nowhere, and every replica count gives one device's numbers. Before, a
per-step weight `(rows, steps)` met the per-example loss `(rows,)` and every backend
crashed. Weights that do not fit the loss (per-step weights for a loss with one value per
row) or the prediction (for the weighted metrics) are an error naming both shapes."""

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


def _per_row_loop(acc):
    """One prediction per row, `(rows, classes)`: its loss has one value per row."""
    with acc.scope():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((STEPS,), dtype="int32")
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
        return acc.loop(
            model,
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("weighted_accuracy")],
        )


PER_ROW_LOSS_WITH_STEP_WEIGHTS = (
    r"one value per row, shape \((\d+),\).*the weights have shape \(\1, 6\)\. "
    r"A loss with one value per row takes weights of shape \(\1,\) or \(\1, 1\)\. "
    r"Weights per step, \(rows, steps\), need a loss with one value per step.*"
    r'reduction="none".*\(rows, steps, classes\)'
)


# One device with a batch of STEPS rows: there (rows,) * (rows, steps) broadcast silently
# into (rows, rows) before, where other shapes failed deep in the step.
@pytest.mark.parametrize("devices, batch", [(NUM_DEVICES, BATCH), (1, STEPS)], ids=["all", "one"])
@pytest.mark.parametrize("kind", ["train", "test"])
def test_per_step_weights_for_a_loss_per_row_are_a_clear_error(devices, batch, kind):
    tokens, _, weights = _data()
    labels = np.random.default_rng(1).integers(0, CLASSES, ROWS)
    loop = _per_row_loop(Accelerator(devices=devices, seed=0))
    batches = loop.batches(tokens, labels, batch, sample_weight=weights, training=kind == "train")
    step = loop.train_step if kind == "train" else loop.test_step
    with pytest.raises(ValueError, match=PER_ROW_LOSS_WITH_STEP_WEIGHTS):
        step(next(iter(batches)))


def test_a_loss_per_row_takes_weights_of_shape_rows_or_rows_by_one():
    tokens, _, weights = _data()
    labels = np.random.default_rng(1).integers(0, CLASSES, ROWS)
    loop = _per_row_loop(Accelerator(seed=0))
    flat = loop.evaluate(tokens, labels, BATCH, sample_weight=weights[:, 0])
    column = loop.evaluate(tokens, labels, BATCH, sample_weight=weights[:, :1])
    for name in flat:
        np.testing.assert_allclose(column[name], flat[name], rtol=1e-6, err_msg=name)


def test_per_example_losses_names_weights_that_do_not_fit_the_loss_values():
    from keras_accel.loop import per_example_losses

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows = 4
    per_row = keras.ops.zeros((rows, CLASSES))
    labels = keras.ops.zeros((rows,), dtype="int32")
    # (rows, 1, 1) broadcast into (rows, 1, rows) before.
    with pytest.raises(ValueError, match=r"shape \(4,\).*weights have shape \(4, 1, 1\)"):
        per_example_losses(loss, labels, per_row, keras.ops.ones((rows, 1, 1)))
    per_step = keras.ops.zeros((rows, STEPS, CLASSES))
    step_labels = keras.ops.zeros((rows, STEPS), dtype="int32")
    with pytest.raises(
        ValueError, match=r"values of shape \(4, 6\).*weights have shape \(4, 7\).*\(rows,\) up to"
    ):
        per_example_losses(loss, step_labels, per_step, keras.ops.ones((rows, STEPS + 1)))
    for fits in [(rows,), (rows, 1), (rows, STEPS), (rows, STEPS, 1)]:
        got = per_example_losses(loss, step_labels, per_step, keras.ops.ones(fits))
        assert tuple(got.shape) == (rows,)


def test_metric_updates_names_per_step_weights_for_a_prediction_per_row():
    from types import SimpleNamespace

    from keras_accel.loop import metric_updates

    rows = 4
    loop = SimpleNamespace(
        loss_tracker=keras.metrics.Mean(name="loss"),
        metrics=[],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("weighted_accuracy")],
    )
    mask = keras.ops.ones((rows,))
    per = keras.ops.zeros((rows,))
    step_weights = keras.ops.ones((rows, STEPS))
    per_row, labels = keras.ops.zeros((rows, CLASSES)), keras.ops.zeros((rows,), dtype="int32")
    with pytest.raises(
        ValueError,
        match=r"weights have shape \(4, 6\) and the prediction has shape \(4, 4\).*"
        r"need a prediction per step, \(rows, steps, classes\)",
    ):
        list(metric_updates(loop, labels, per_row, per, step_weights, mask))
    per_step = keras.ops.zeros((rows, STEPS, CLASSES))
    step_labels = keras.ops.zeros((rows, STEPS), dtype="int32")
    updates = list(metric_updates(loop, step_labels, per_step, per, step_weights, mask))
    assert [metric for metric, _, _ in updates] == [loop.loss_tracker, *loop.weighted_metrics]
