"""A model's own `train_step` that honours `sample_weight` (the weighted step of Keras's
guide "Customizing what happens in fit()") is given the last partial batch padded, weighted
0, by default: it trains every row, as plain one-device Keras does. A step that reads no
weights still gets `(x, y)` and its last partial batch is dropped, with a note."""

import contextlib
import warnings

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.adapter.steps import honours_sample_weight
from tests.conftest import NUM_DEVICES
from tests.helpers import (
    FEW_REPLICAS,
    assert_weights_close,
    stream,
    unpadded_remainder,
    unpadded_stream,
    weights_of,
)

pytestmark = pytest.mark.torch

ROWS, BATCH = 21, 8  # The last batch holds 5 rows.


class Weighted(keras.Model):
    """Keras's guide, "Supporting sample_weight & class_weight", on every backend: the
    weights are read from the data and handed on (the gradient is Keras's own step's; JAX's
    steps take the state first)."""

    def train_step(self, *args):
        *state, data = args
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        return super().train_step(*state, (x, y, sample_weight))


class Unweighted(keras.Model):
    def train_step(self, *args):
        *state, data = args
        x, y = data[0], data[1]
        return super().train_step(*state, (x, y))


def _model(cls):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(3)(inputs))
    model.compile(
        keras.optimizers.SGD(0.2),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data():
    rng = np.random.default_rng(5)
    return rng.normal(size=(ROWS, 4)).astype("float32"), rng.integers(0, 3, ROWS)


def test_the_step_is_read_for_sample_weight():
    assert honours_sample_weight(_model(Weighted))
    assert not honours_sample_weight(_model(Unweighted))


@pytest.fixture(scope="module")
def acc():
    return Accelerator(devices=NUM_DEVICES)


def test_a_step_that_honours_weights_trains_every_row_by_default(acc):
    x, y = _data()
    with acc.scope():
        ours = _model(Weighted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # No note: nothing is dropped.
        history = acc.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    plain = _model(Weighted)
    expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))


@pytest.mark.parametrize("kind", ["generator", "PyDataset", "tf.data"])
@pytest.mark.parametrize("devices", sorted({1, NUM_DEVICES}))
def test_a_step_that_reads_no_weights_trains_and_evaluates_a_stream_unpadded(kind, devices):
    # Read as it comes, a short batch is known when it arrives: marked then (a tf.data
    # pipeline's in its graph), it runs as its real rows, as plain Keras runs it (a
    # generator's first batch, read to learn the batch size, is not lost on the way); over
    # several TensorFlow replicas whole in each (read on the host, not split by
    # tf.distribute; 2 replicas there: the subject is the split, not the count, and
    # TensorFlow traces every replica). Over torch's processes a tf.data pipeline's is
    # dropped in training and an evaluation is refused.
    if keras.backend.backend() == "tensorflow" and devices > 1:
        devices = FEW_REPLICAS
    one = Accelerator(devices=devices)
    x, y = _data()
    with one.scope():
        ours = _model(Unweighted)
    plain = _model(Unweighted)
    steps = []
    counted = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.append(1))
    if not unpadded_stream(one, kind):
        with pytest.warns(UserWarning, match="overrides train_step and gets \\(x, y\\) batches"):
            one.fit(ours, stream(kind, x, y, BATCH), epochs=1, verbose=0, callbacks=[counted])
        # (Not the optimizer's iterations: on TensorFlow Keras counts one more for a
        # generator.)
        assert len(steps) == ROWS // BATCH
        with pytest.raises(ValueError, match="overrides test_step and gets"):
            one.evaluate(_checked(ours, one), stream(kind, x, y, BATCH), verbose=0)
        return
    with pytest.warns(UserWarning, match="that is not full .* runs unpadded"):
        history = one.fit(
            ours, stream(kind, x, y, BATCH), epochs=1, shuffle=False, verbose=0, callbacks=[counted]
        )
    expected = plain.fit(stream(kind, x, y, BATCH), epochs=1, shuffle=False, verbose=0)
    assert len(steps) == -(-ROWS // BATCH)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))
    ours, plain = _checked(ours, one), _checked(plain)
    with pytest.warns(UserWarning, match="runs unpadded"):
        got = one.evaluate(ours, stream(kind, x, y, BATCH), verbose=0, return_dict=True)
    want = plain.evaluate(stream(kind, x, y, BATCH), verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=1e-5)


def _checked(model, acc=None):
    """`model`'s weights in a model whose `test_step` reads no weights (`Unpacking`), built
    in `acc`'s scope where given."""
    with acc.scope() if acc is not None else contextlib.nullcontext():
        other = _model(Unpacking)
    other.set_weights(model.get_weights())
    return other


@pytest.mark.parametrize("devices", sorted({1, NUM_DEVICES}))
def test_a_step_that_reads_no_weights_trains_every_row_unpadded(devices):
    # Several replicas: JAX cuts the batch to its real rows, TensorFlow's replicas each run
    # it whole (torch's processes: test_torch_replicated.py).
    one = Accelerator(devices=devices)
    x, y = _data()
    with one.scope():
        ours = _model(Unweighted)
    plain = _model(Unweighted)
    with pytest.warns(UserWarning, match=r"gets \(x, y\) batches; the last partial batch \(5 of"):
        history = one.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))
    assert one.num_recompiles == 0  # The last batch's shape is expected, not a recompile.


class Unpacking(keras.Model):
    def test_step(self, *args):
        *state, data = args
        x, y = data  # Cannot take the padding weights an uneven evaluation needs.
        return super().test_step(*state, (x, y))


def test_a_step_that_cannot_take_padding_weights_is_told_why_and_what_works(acc):
    x, y = _data()
    with acc.scope():
        ours = _model(Unpacking)
    if not unpadded_remainder(acc):  # Refused before it runs, naming it and what works.
        with pytest.raises(
            ValueError, match=r"Unpacking overrides test_step and gets \(x, y\) batches.* pads"
        ):
            acc.evaluate(ours, x, y, batch_size=BATCH, verbose=0)
    one = Accelerator(devices=1)  # One replica: its last batch unpadded, as in plain Keras.
    with one.scope():
        ours = _model(Unpacking)
    plain = _model(Unpacking)
    with pytest.warns(UserWarning, match="runs unpadded"):
        got = one.evaluate(ours, x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert got == pytest.approx(plain.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True))
