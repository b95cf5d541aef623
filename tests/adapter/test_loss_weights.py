"""A padded step's weights as each loss needs them (keras_accel/adapter/loss_weights.py),
and as a custom step's own metrics need them: on uneven data (21 rows in batches of 8, a last
batch of 5 real rows padded) every model here trains and evaluates as plain one-device Keras
does on the real rows (`shuffle=False` both), on the suite's devices.

Each case was wrong before: a sum counted the padding factor (`static / real rows`), a loss
with one value per row of an image met weights `(rows, 1, 1)` and broadcast into
`(rows, 1, rows)`, a masked sum was normalised as a mean, targets given as a dict met the
outputs' ranks in the outputs' order, and a custom step's own metric updated without weights
counted the padding rows."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from tests.conftest import BACKEND, NUM_DEVICES
from tests.helpers import FEW_REPLICAS, assert_weights_close, weights_of

pytestmark = pytest.mark.torch

ROWS, BATCH = 21, 8


@pytest.fixture(scope="module")
def acc():
    # TensorFlow traces every step once per replica: two take every cross-replica path
    # (`FEW_REPLICAS`); the subject here is how losses weight padding, not the count.
    return Accelerator(devices=FEW_REPLICAS if BACKEND == "tensorflow" else NUM_DEVICES)


def _both(acc, build, x, y, epochs=2, sample_weight=None):
    """Fit then evaluate, ours and plain one-device Keras: (logs, evaluation, weights)."""
    results = []
    for ours in (True, False):
        if ours:
            with acc.scope():
                model = build()
            fit, evaluate = acc.fit, acc.evaluate
            args = (model,)
        else:
            model = build()
            fit, evaluate = model.fit, model.evaluate
            args = ()
        common = dict(batch_size=BATCH, sample_weight=sample_weight, verbose=0)
        history = fit(*args, x, y, epochs=epochs, shuffle=False, **common)
        evaluated = evaluate(*args, x, y, return_dict=True, **common)
        results.append((history.history, evaluated, weights_of(model)))
    return results


def _assert_same(ours, plain, rtol=1e-5):
    (history, evaluated, weights), (plain_history, plain_evaluated, plain_weights) = ours, plain
    assert sorted(history) == sorted(plain_history)
    for name in plain_history:
        np.testing.assert_allclose(history[name], plain_history[name], rtol=rtol, err_msg=name)
    for name in plain_evaluated:
        np.testing.assert_allclose(evaluated[name], plain_evaluated[name], rtol=rtol, err_msg=name)
    assert_weights_close(weights, plain_weights)


def _mlp(loss, metrics=("mae",)):
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(keras.optimizers.SGD(0.01), loss, metrics=list(metrics))
    return model


def test_a_summed_loss_is_the_sum_over_the_real_rows(acc):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    ours, plain = _both(acc, lambda: _mlp(keras.losses.MeanSquaredError(reduction="sum")), x, y)
    _assert_same(ours, plain)


def test_a_loss_divided_by_its_weights_sum_is_the_global_batchs_weighted_mean(acc):
    # "mean_with_sample_weight" divides by the weights' sum: over replicas or processes
    # each divides by its own, whose average is not the global quotient where the users'
    # weights (and the padding) differ between them.
    rng = np.random.default_rng(4)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 3)).astype("float32")
    weights = rng.uniform(0.0, 3.0, ROWS).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    ours, plain = _both(acc, lambda: _mlp(loss), x, y, sample_weight=weights)
    _assert_same(ours, plain)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_one_loss_object_serving_two_outputs_is_each_outputs_own(acc, reduction):
    # `compile(loss=L)` on a model of two outputs: Keras calls the one object for each. A
    # factor of ours applied per wrapping would be applied twice.
    def build():
        keras.utils.set_random_seed(9)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = keras.Model(
            inputs,
            [keras.layers.Dense(3, name="a")(hidden), keras.layers.Dense(2, name="b")(hidden)],
        )
        model.compile(
            keras.optimizers.SGD(0.01), keras.losses.MeanSquaredError(reduction=reduction)
        )
        return model

    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = [rng.normal(size=(ROWS, 3)).astype("float32"), rng.normal(size=(ROWS, 2)).astype("float32")]
    weights = rng.uniform(0.0, 3.0, ROWS).astype("float32")
    ours, plain = _both(acc, build, x, y, sample_weight=weights)
    if keras.backend.backend() == "tensorflow":
        # Plain Keras on TF averages each output's loss over the batches unweighted
        # (tests/adapter/test_sequence_targets.py): only the total and the weights compare.
        for logs in (ours[0], plain[0], ours[1], plain[1]):
            for name in ("a_loss", "b_loss"):
                logs.pop(name)
    _assert_same(ours, plain)


def _segmenter(loss):
    keras.utils.set_random_seed(6)
    images = keras.Input((4, 4, 2))
    hidden = keras.layers.Conv2D(4, 3, padding="same", activation="tanh")(images)
    model = keras.Model(
        images, keras.layers.Conv2D(1, 1, activation="sigmoid", name="mask")(hidden)
    )
    model.compile(keras.optimizers.SGD(0.5), loss, metrics=["mae"])
    return model


def _per_image_error(y_true, y_pred):  # One value per image: every axis but the rows reduced.
    return ops.mean(ops.square(y_true - y_pred), axis=(1, 2, 3))


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.Dice(axis=(1, 2, 3)),
        _per_image_error,
        keras.losses.BinaryCrossentropy(),  # One value per pixel: (rows, 4, 4).
    ],
    ids=["dice_per_image", "function_per_image", "per_pixel"],
)
def test_an_image_output_whose_loss_has_one_value_per_row_or_per_pixel(acc, loss):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, 4, 4, 2)).astype("float32")
    y = (rng.uniform(size=(ROWS, 4, 4, 1)) > 0.5).astype("float32")
    ours, plain = _both(acc, lambda: _segmenter(loss), x, y)
    _assert_same(ours, plain)


def _masked_tagger(reduction):
    keras.utils.set_random_seed(7)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(12, 8, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(4)(hidden))
    model.compile(
        keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
    )
    return model


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
def test_a_masked_sequence_loss_that_is_no_mean_over_steps(acc, reduction):
    # Keras normalises a masked loss by its unmasked steps for its means only: a sum adds
    # the unmasked steps' values, "mean_with_sample_weight" divides by the mask's sum (on
    # TensorFlow each replica by its own, unless made its share of the global quotient).
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, 12, (ROWS, 6))
    lengths = rng.integers(2, 7, ROWS)
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0
    tags = rng.integers(0, 4, (ROWS, 6))
    ours, plain = _both(acc, lambda: _masked_tagger(reduction), tokens, tags)
    _assert_same(ours, plain)


def _named_outputs():
    """A list of outputs whose names sort the other way round, one of them a sequence:
    targets given as a dict are matched to them by name, as Keras matches them."""
    keras.utils.set_random_seed(8)
    inputs = keras.Input((5, 3))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    steps = keras.layers.Dense(2, name="z_steps")(hidden)
    whole = keras.layers.Dense(3, name="a_whole")(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, [steps, whole])
    model.compile(
        keras.optimizers.SGD(0.1),
        {
            "z_steps": keras.losses.MeanAbsoluteError(),
            "a_whole": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
    )
    return model


def test_dict_targets_of_a_list_of_outputs_are_weighted_by_name(acc):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 5, 3)).astype("float32")
    y = {
        "z_steps": rng.normal(size=(ROWS, 5, 2)).astype("float32"),
        "a_whole": rng.integers(0, 3, ROWS),
    }
    ours, plain = _both(acc, _named_outputs, x, y)
    if keras.backend.backend() == "tensorflow":
        # Plain Keras on TF averages each output's loss over the batches unweighted
        # (tests/adapter/test_sequence_targets.py): only the total and the weights compare.
        for logs in (ours[0], plain[0], ours[1], plain[1]):
            for name in ("z_steps_loss", "a_whole_loss"):
                logs.pop(name)
    _assert_same(ours, plain)


class OwnMetricStep(keras.Model):
    """Keras's guide's weighted step, with an error metric of its own that it updates
    without the weights (as a step written for unweighted data does)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.error = keras.metrics.MeanAbsoluteError(name="error")
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if keras.backend.backend() == "torch":
            self.zero_grad()
            loss = self.compute_loss(
                y=y, y_pred=self(x, training=True), sample_weight=sample_weight
            )
            loss.backward()
            grads = [v.value.grad for v in self.trainable_weights]
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
            grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        self.loss_tracker.update_state(loss)
        self.error.update_state(y, self(x, training=False))
        return {"loss": self.loss_tracker.result(), "error": self.error.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.error]


def test_a_custom_step_s_own_metric_updated_without_weights_skips_padding_rows(acc):
    if keras.backend.backend() == "jax":
        pytest.skip(
            "JAX's custom steps are stateless (tests/adapter/test_guide_custom_step_jax.py)"
        )
    rng = np.random.default_rng(4)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(9)
        model = OwnMetricStep()
        model.compile(keras.optimizers.SGD(0.05), "mse")
        model.build((None, 6))
        return model

    with acc.scope():
        ours = build()
    history = acc.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    plain = build()
    plain_history = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for name in ("loss", "error"):
        np.testing.assert_allclose(
            history.history[name], plain_history.history[name], rtol=1e-5, err_msg=name
        )
    assert_weights_close(weights_of(ours), weights_of(plain))
