"""A user's loss or metric that padding rows would make inexact is found before the first
step: training drops the last partial batch with a note naming it, evaluation refuses; one
that honours sample_weight stays padded and exact. Against plain single-device Keras, on
two replicas (what matters is that a batch pads, not how many replicas share it)."""

import os
import warnings

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from tests.helpers import unpadded_remainder

DEVICES = min(2, int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8")))
ROWS, BATCH = 100, 16  # The last batch holds 4 rows: padded to 16.


class Blind(keras.metrics.Metric):
    """Accuracy that ignores sample_weight, as a hand-written metric may."""

    def __init__(self, name="blind", **kwargs):
        super().__init__(name=name, **kwargs)
        self.hits = self.add_variable((), initializer="zeros", name="hits")
        self.rows = self.add_variable((), initializer="zeros", name="rows")

    def update_state(self, y_true, y_pred, sample_weight=None):
        guess = ops.cast(ops.argmax(y_pred, -1), "int32")
        self.hits.assign_add(ops.sum(ops.cast(guess == ops.cast(y_true, "int32"), "float32")))
        self.rows.assign_add(ops.cast(ops.shape(y_true)[0], "float32"))

    def result(self):
        return self.hits / self.rows


class Honest(Blind):
    """The same accuracy, honouring sample_weight."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        guess = ops.cast(ops.argmax(y_pred, -1), "int32")
        hit = ops.cast(guess == ops.cast(y_true, "int32"), "float32")
        w = ops.ones_like(hit) if sample_weight is None else ops.cast(sample_weight, "float32")
        self.hits.assign_add(ops.sum(hit * w))
        self.rows.assign_add(ops.sum(w))


def scalar_loss(y_true, y_pred):
    return ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))


def _model(loss=None, metrics=()):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1), loss, metrics=list(metrics))
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 4)).astype("float32"), rng.integers(0, 3, ROWS)


@pytest.fixture(scope="module")
def acc():
    return Accelerator(devices=DEVICES)


def test_a_metric_that_ignores_weights_is_refused_in_evaluation_and_one_that_honours_them_is_exact(
    acc,
):
    x, y = _data()
    with acc.scope():
        blind = _model(metrics=[Blind()])
    if unpadded_remainder(acc):  # The last batch's 4 rows alone, as plain Keras has them.
        with pytest.warns(UserWarning, match="metric 'blind' counts rows .* runs unpadded"):
            ours = acc.evaluate(blind, x, y, batch_size=BATCH, verbose=0)
        plain = _model(metrics=[Blind()]).evaluate(x, y, batch_size=BATCH, verbose=0)
        np.testing.assert_allclose(ours, plain, rtol=1e-6)
        return
    with pytest.raises(ValueError, match="metric 'blind' counts rows whose sample_weight is 0"):
        acc.evaluate(blind, x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match=r"`validation_data` pads its batches \(100 rows"):
        acc.fit(blind, x[:96], y[:96], batch_size=BATCH, validation_data=(x, y), verbose=0)
    assert (
        int(keras.ops.convert_to_numpy(blind.optimizer.iterations)) == 0
    )  # Refused before the first step.
    # Where nothing pads, the same metric is exact and allowed.
    plain = _model(metrics=[Blind()]).evaluate(x[:96], y[:96], batch_size=BATCH, verbose=0)
    ours = acc.evaluate(blind, x[:96], y[:96], batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(ours, plain, rtol=1e-6)

    with acc.scope():
        honest = _model(metrics=[Honest()])
    ours = acc.evaluate(honest, x, y, batch_size=BATCH, verbose=0, return_dict=True)
    plain = _model(metrics=[Honest()]).evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert ours["blind"] == pytest.approx(plain["blind"], abs=1e-7)
    assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-6)


def test_a_loss_that_returns_one_value_per_batch_trains_without_the_partial_batch(acc):
    x, y = _data()
    with acc.scope():
        model = _model(loss=scalar_loss)
    with pytest.warns(UserWarning, match="loss 'scalar_loss' returns one value per batch") as w:
        history = acc.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert w[0].filename == __file__  # The note points at the user's line.
    # Exactly plain Keras: the 4 rows of the partial batch alone (unpadded), or dropped.
    plain = _model(loss=scalar_loss)
    kept = ROWS if unpadded_remainder(acc) else 96
    expected = plain.fit(x[:kept], y[:kept], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for ours, theirs in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
    # A function metric returning one value per batch is found the same way.
    with acc.scope():
        model = _model(metrics=[scalar_loss])
    if unpadded_remainder(acc):
        with pytest.warns(UserWarning, match="metric 'scalar_loss' counts rows .* unpadded"):
            acc.evaluate(model, x, y, batch_size=BATCH, verbose=0)
    else:
        with pytest.raises(ValueError, match="metric 'scalar_loss' counts rows"):
            acc.evaluate(model, x, y, batch_size=BATCH, verbose=0)


def test_explicit_padding_with_an_inexact_loss_is_refused():
    acc = Accelerator(devices=DEVICES, remainder="pad")
    x, y = _data()
    with acc.scope():
        model = _model(loss=scalar_loss)
    with pytest.raises(ValueError, match="loss 'scalar_loss' returns one value per batch"):
        acc.fit(model, x, y, batch_size=BATCH, verbose=0)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0


class SumsOverTheBatch(keras.Model):
    """keras-io's movie recommender's published mistake: `ops.tensordot(a, b, 2)` sums every
    row's products, so a row's output depends on the other rows of its batch."""

    def __init__(self):
        super().__init__()
        # A bias, so that a row of zeros (padding) has an output, as an embedding of id 0 has.
        self.dense = keras.layers.Dense(
            3, kernel_initializer=keras.initializers.GlorotUniform(0), bias_initializer="ones"
        )

    def call(self, x):
        h = self.dense(x)
        return h + ops.tensordot(h, h, 2)


@pytest.mark.torch
def test_a_model_whose_rows_see_each_other_is_found_and_one_that_does_not_is_not():
    from keras_accel.adapter.exactness import inexact_under_padding

    x, y = _data()
    sample = (x[:16], y[:16], None, np.r_[np.ones(10), np.zeros(6)].astype("float32"))
    coupled = SumsOverTheBatch()
    coupled.compile("sgd", "mse")
    assert inexact_under_padding(coupled, sample) == [
        "SumsOverTheBatch's output for a row depends on the other rows of its batch"
    ]
    assert inexact_under_padding(_model(), sample) == []


def test_a_model_whose_rows_see_each_other_is_named_where_each_replica_has_a_share(backend):
    # TensorFlow's replicas each run the model on their share of every batch: said, not
    # silent. JAX's program sees the whole batch: nothing to say.
    x, y = _data()
    acc = Accelerator(devices=DEVICES)
    with acc.scope():
        coupled = SumsOverTheBatch()
        coupled.compile("sgd", "mse")
    fit = dict(x=x, y=np.zeros((ROWS, 3), "float32"), batch_size=20, epochs=1, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.fit(coupled, **fit)
        acc.evaluate(coupled, x, fit["y"], batch_size=20, verbose=0)
    said = [w for w in caught if "depends on the other rows of its batch" in str(w.message)]
    assert len(said) == (1 if backend == "tensorflow" and DEVICES > 1 else 0), said
    if said:
        assert f"over {DEVICES} replicas each computes from its own share" in str(said[0].message)


class MeanPrediction(keras.metrics.Metric):
    """The batch mean of the first prediction, sample_weight ignored: rows rolled over the
    batch keep it, so only rows moved off the real ones show that padding would count."""

    def __init__(self, name="mean_prediction", **kwargs):
        super().__init__(name=name, **kwargs)
        self.value = self.add_variable((), initializer="zeros", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.value.assign(ops.mean(y_pred[:, 0]))

    def result(self):
        return self.value


@pytest.mark.torch
def test_a_metric_of_the_predictions_mean_that_ignores_weights_is_found():
    from keras_accel.adapter.exactness import inexact_under_padding

    x, y = _data()
    sample = (x[:16], y[:16], None, np.r_[np.ones(10), np.zeros(6)].astype("float32"))
    assert inexact_under_padding(_model(metrics=[MeanPrediction()]), sample) == [
        "metric 'mean_prediction' counts rows whose sample_weight is 0"
    ]
