"""Code of the model's own that computes over every row of a batch (a `compute_loss` that
drops `sample_weight`, a layer's `add_loss`, an `activity_regularizer`) is never handed padding
rows: training drops the last partial batch with a note naming it, and an evaluation that
would pad is refused, naming it. Plain Keras never pads, so padding there changed its numbers
without a word (keras-io's knowledge distillation: the loss 1.8% off). Also the data contract
without targets: a custom step gets `x` where Keras passes `x`, not `(x,)`."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from keras_accel.adapter.unweighted import hands_on_sample_weight, unweighted_code
from tests.conftest import NUM_DEVICES
from tests.helpers import FEW_REPLICAS, assert_weights_close, stream, unpadded_remainder, weights_of
from tests.keras_io.vision import Distiller  # keras-io's, as published

pytestmark = pytest.mark.torch

ROWS, BATCH = 21, 8  # The last batch holds 5 rows.


class WeightedDistiller(Distiller):
    """The same, handing the weights on: given the padded batch, weighted 0."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        return self.student_loss_fn(y, y_pred, sample_weight=sample_weight)


def _net(seed):
    init = keras.initializers.GlorotUniform(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, kernel_initializer=init)])


def _distiller(cls=Distiller):
    model = cls(_net(1), _net(2))
    model.compile(
        keras.optimizers.SGD(0.1),
        ["sparse_categorical_accuracy"],
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=3.0,
    )
    return model


class Endpoint(keras.layers.Layer):
    """keras-io's keras_recipes/endpoint_layer_pattern.py: the loss is the layer's own."""

    def __init__(self):
        super().__init__()
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, targets, logits):
        self.add_loss(self.loss_fn(targets, logits))
        return ops.sigmoid(logits)


def _endpoint():
    inputs = keras.Input((4,), name="inputs")
    targets = keras.Input((1,), name="targets")
    logits = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))(inputs)
    model = keras.Model([inputs, targets], Endpoint()(targets, logits))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def _data():
    rng = np.random.default_rng(5)
    return rng.normal(size=(ROWS, 4)).astype("float32"), rng.integers(0, 3, ROWS)


# Every backend runs numeric arrays' last partial batch unpadded (`helpers.unpadded_remainder`):
# one replica, JAX on any devices, each of several TensorFlow replicas whole.
COUNTS = sorted({1, NUM_DEVICES})


@pytest.fixture(scope="module", params=COUNTS, ids=[f"{n}_replicas" for n in COUNTS])
def acc(request):
    return Accelerator(devices=request.param)


def _kept(acc, rows=ROWS):
    """The rows `fit` trains on: all where the last partial batch runs unpadded."""
    return rows if unpadded_remainder(acc) else rows // BATCH * BATCH


def test_the_models_own_code_is_read_for_what_weights_rows():
    assert any(
        "Distiller.compute_loss does not hand on" in f for f in unweighted_code(_distiller())
    )
    assert unweighted_code(_distiller(WeightedDistiller)) == []
    assert any("calls add_loss" in f for f in unweighted_code(_endpoint()))
    regularized = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, activity_regularizer="l2", name="act")]
    )
    assert unweighted_code(regularized) == [
        "layer 'act' (activity_regularizer) adds a loss computed over every row of the batch"
    ]
    # Keras's own layers, kernel regularizers (no rows in them) and a step's unpacked but
    # never read weights do not count.
    plain = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(2, kernel_regularizer="l2"),
            keras.layers.Dropout(0.1),
        ]
    )
    assert unweighted_code(plain) == []

    def unpacked_only(self, data):
        x, y, sample_weight = data
        return x

    assert not hands_on_sample_weight(unpacked_only)


def test_a_compute_loss_without_weights_never_sees_padding_rows(acc, backend):
    x, y = _data()
    with acc.scope():
        ours = _distiller()
    plain = _distiller()
    plain.set_weights(ours.get_weights())
    with pytest.warns(UserWarning, match=r"Distiller.compute_loss does not hand on .*\(5 of 21"):
        history = acc.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    # Padding rows would count in its loss: the last partial batch runs unpadded (one
    # replica; JAX; each of several TensorFlow replicas whole) or is dropped elsewhere.
    kept = _kept(acc)
    expected = plain.fit(x[:kept], y[:kept], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))
    assert acc.num_recompiles == 0
    # An evaluation must see every row: unpadded (one replica; JAX), refused on several
    # TensorFlow replicas where it would pad, naming the code...
    if unpadded_remainder(acc):
        with pytest.warns(UserWarning, match="runs unpadded"):
            got = acc.evaluate(ours, x, y, batch_size=BATCH, verbose=0, return_dict=True)
        want = plain.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        assert got == pytest.approx(want, rel=1e-5)
    else:
        with pytest.raises(ValueError, match=r"Distiller.compute_loss does not hand on .* pads"):
            acc.evaluate(ours, x, y, batch_size=BATCH, verbose=0)
    # ...and as plain Keras where nothing pads.
    ours_logs = acc.evaluate(ours, x[:16], y[:16], batch_size=BATCH, verbose=0, return_dict=True)
    plain_logs = plain.evaluate(x[:16], y[:16], batch_size=BATCH, verbose=0, return_dict=True)
    assert ours_logs == pytest.approx(plain_logs, rel=1e-5)


@pytest.mark.parametrize("kind", ["generator", "PyDataset", "tf.data"])
def test_a_compute_loss_without_weights_sees_a_streams_short_batch_whole(kind, backend):
    # A stream's short batch is known only when it arrives: it runs as its real rows, as
    # plain Keras runs it, on one device, on JAX, over torch's processes (test_torch_
    # replicated.py) and over TensorFlow's replicas, whole in each (read on the host, not
    # split by tf.distribute; a tf.data pipeline's marked in its graph), in training,
    # validation and evaluation (2 replicas: the subject is the split, not the count).
    # JAX's cut of a stream's short batch is test_custom_step_padding.py's (the same route;
    # compiling it here took 16 s), as are tf.data's other routes.
    if backend == "jax":
        pytest.skip("JAX's stream route: test_custom_step_padding.py")
    if kind == "tf.data" and backend != "tensorflow":
        pytest.skip("tf.data's route over TensorFlow's replicas")
    acc = Accelerator(devices=FEW_REPLICAS if NUM_DEVICES > 1 else 1)
    x, y = _data()
    with acc.scope():
        ours = _distiller()
    plain = _distiller()
    plain.set_weights(ours.get_weights())
    # The note says which way it runs.
    where = (
        f", whole in each of the {acc.num_replicas} replicas" if acc.num_replicas > 1 else " \\("
    )
    note = f"Distiller.compute_loss does not hand on .* not full .* runs it{where}"
    with pytest.warns(UserWarning, match=note):
        history = acc.fit(
            ours,
            stream(kind, x, y, BATCH),
            validation_data=stream(kind, x, y, BATCH),
            epochs=1,
            shuffle=False,
            verbose=0,
        )
    expected = plain.fit(
        stream(kind, x, y, BATCH),
        validation_data=stream(kind, x, y, BATCH),
        epochs=1,
        shuffle=False,
        verbose=0,
    )
    for name in ("loss", "val_loss", "val_sparse_categorical_accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))
    with pytest.warns(UserWarning, match="not full"):
        got = acc.evaluate(ours, stream(kind, x, y, BATCH), verbose=0, return_dict=True)
    want = plain.evaluate(stream(kind, x, y, BATCH), verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=1e-5)
    assert acc.num_recompiles == 0  # The short batch's step is expected, not a recompile.


def test_a_compute_loss_that_hands_the_weights_on_trains_every_row(acc, backend):
    x, y = _data()
    with acc.scope():
        ours = _distiller(WeightedDistiller)
    plain = _distiller(WeightedDistiller)
    plain.set_weights(ours.get_weights())
    history = acc.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expected = plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))


def test_a_layers_add_loss_never_sees_padding_rows(acc, backend):
    x, _ = _data()
    targets = (x[:, :1] > 0).astype("float32")
    data = {"inputs": x, "targets": targets}
    with acc.scope():
        ours = _endpoint()
    plain = _endpoint()
    plain.set_weights(ours.get_weights())
    with pytest.warns(UserWarning, match=r"\(5 of 21 rows"):
        history = acc.fit(ours, data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    kept = {name: value[: _kept(acc)] for name, value in data.items()}
    expected = plain.fit(kept, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(plain))


class SeesWhatKerasPasses(keras.Model):
    """A step without targets (keras-io's VAE: `z = self.encoder(data)`) records what it
    is given while it is traced."""

    seen: list = []

    def predict_step(self, *args):
        *state, data = args
        SeesWhatKerasPasses.seen.append(type(data).__name__)
        return super().predict_step(*state, data)


def test_a_step_without_targets_gets_x_as_keras_passes_it(acc):
    def make():
        inputs = keras.Input((4,))
        dense = keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(4))
        return SeesWhatKerasPasses(inputs, dense(inputs))

    x = np.random.default_rng(1).normal(size=(ROWS, 4)).astype("float32")
    with acc.scope():
        ours = make()
    plain = make()
    plain.set_weights(ours.get_weights())
    SeesWhatKerasPasses.seen = []
    expected = plain.predict(x, batch_size=BATCH, verbose=0)
    keras_saw = set(SeesWhatKerasPasses.seen)
    SeesWhatKerasPasses.seen = []
    predicted = acc.predict(ours, x, batch_size=BATCH, verbose=0)
    assert keras_saw and "tuple" not in keras_saw  # One array: Keras passes it as it is.
    assert SeesWhatKerasPasses.seen and "tuple" not in SeesWhatKerasPasses.seen
    np.testing.assert_allclose(predicted, expected, rtol=1e-5, atol=1e-6)
