"""Batches that grow: a stream whose later batches are larger than its first (Keras's own
`test_predict_preserve_order`: batches of 2, 3, 4 rows). Plain Keras takes any batch size
from a generator, a PyDataset or tf.data; the Accelerator pads a larger batch to a bucket
(the first static size doubled until it fits) and must give plain one-device Keras's
results: weights and losses after fit, evaluate's logs, predictions in order.

The sizes below give buckets above the first static size on every device count: 5 rows
first (8 on 8 replicas, 6 on 2, 5 on 1), then 16 and 11.
"""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.data import sources
from keras_accel.data.batching import bucket_rows, share_rows
from tests.helpers import FEW_REPLICAS, assert_weights_close, compiled_mlp, data

pytestmark = pytest.mark.torch

SIZES = (5, 16, 11, 11)  # 43 rows.
# TensorFlow traces every step once per replica: two replicas take every cross-replica
# path (`FEW_REPLICAS`); JAX's one program runs on every device.
DEVICES = {"devices": FEW_REPLICAS} if keras.backend.backend() == "tensorflow" else {}
X, Y = data(sum(SIZES))


def _bounds():
    stops = np.cumsum(SIZES)
    return list(zip(stops - np.asarray(SIZES), stops))


def _growing(with_targets=True):
    for start, stop in _bounds():
        yield (X[start:stop], Y[start:stop]) if with_targets else X[start:stop]


class _Growing(keras.utils.PyDataset):
    def __init__(self):
        super().__init__()

    def __len__(self):
        return len(SIZES)

    def __getitem__(self, index):
        start, stop = _bounds()[index]
        return X[start:stop], Y[start:stop]


def _pair(acc):
    with acc.scope():
        model = compiled_mlp()
    twin = compiled_mlp()
    twin.set_weights(model.get_weights())
    return model, twin


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(sources, "_GROWTH_NOTES", set())


def test_bucket_rows_doubles_the_first_static_size_until_the_batch_fits():
    assert [bucket_rows(rows, 8) for rows in (1, 8, 9, 16, 17, 33)] == [8, 8, 16, 16, 32, 64]
    assert bucket_rows(3, 2) == 4 and bucket_rows(4, 2) == 4
    # A process's share of a bucket is the same fraction as of the first static size.
    assert share_rows(slice(4, 8), 8, 32) == slice(16, 32)
    assert share_rows(slice(4, 8), 8, 8) == slice(4, 8)
    assert share_rows(None, 8, 32) is None


def _check_like_keras(acc, model, twin, make):
    with pytest.warns(UserWarning, match=r"has 16 rows, more than its first batch \(5 rows"):
        # In order (a PyDataset's batches would be drawn in another order by each).
        got = acc.fit(model, make(), epochs=1, shuffle=False, verbose=0)
    want = twin.fit(make(), epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    assert_weights_close(model.get_weights(), twin.get_weights())
    logs = acc.evaluate(model, make(), verbose=0, return_dict=True)
    for name, value in twin.evaluate(make(), verbose=0, return_dict=True).items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-5, err_msg=name)


def test_a_growing_generator_trains_evaluates_and_predicts_as_keras():
    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    _check_like_keras(acc, model, twin, _growing)
    predictions = acc.predict(model, _growing(with_targets=False), verbose=0)
    np.testing.assert_allclose(predictions, twin.predict(X, verbose=0), atol=1e-6)


def test_a_growing_pydataset_trains_evaluates_and_predicts_as_keras():
    acc = Accelerator(steps_per_execution=1, **DEVICES)
    model, twin = _pair(acc)
    _check_like_keras(acc, model, twin, _Growing)
    predictions = acc.predict(model, _Growing(), verbose=0)
    np.testing.assert_allclose(predictions, twin.predict(X, verbose=0), atol=1e-6)


def test_growing_tf_data_batches_train_evaluate_and_predict_as_keras():
    tf = pytest.importorskip("tensorflow")

    def make():
        return tf.data.Dataset.from_generator(
            _growing,
            output_signature=(
                tf.TensorSpec((None, X.shape[1]), tf.float32),
                tf.TensorSpec((None,) + Y.shape[1:], tf.as_dtype(Y.dtype)),
            ),
        )

    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    # No note here: tf.data pads in its graph. On JAX each bucket is a new trace, which
    # the recompile guard names after warm-up; TensorFlow traces once, rows unknown.
    got = acc.fit(model, make(), epochs=1, verbose=0)
    want = twin.fit(make(), epochs=1, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    assert_weights_close(model.get_weights(), twin.get_weights())
    logs = acc.evaluate(model, make(), verbose=0, return_dict=True)
    for name, value in twin.evaluate(make(), verbose=0, return_dict=True).items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-5, err_msg=name)
    # Keras's own test: uneven batches of 2, 3 and 4 rows, predictions in order.
    sizes = (2, 3, 4) * 11 + (1,)
    values = np.arange(sum(sizes), dtype="float32")
    stops = np.cumsum(sizes)

    def uneven():
        for start, stop in zip(stops - np.asarray(sizes), stops):
            yield values[start:stop]

    inputs = keras.Input(shape=())
    with acc.scope():
        identity = keras.Model(inputs, keras.layers.Identity()(inputs))
        identity.compile(loss="mse", optimizer="sgd")
    dataset = tf.data.Dataset.from_generator(
        uneven, output_signature=tf.TensorSpec((None,), tf.float32)
    )
    np.testing.assert_array_equal(acc.predict(identity, dataset, verbose=0), values)
    np.testing.assert_array_equal(acc.predict(identity, uneven(), verbose=0), values)


def test_only_a_pipeline_without_a_known_batch_size_loses_its_static_rows():
    # Where a `batch` step says the batch size, nothing larger comes: the padded batches
    # keep a static batch dimension (what a TPU's compiled step needs). Only a pipeline
    # that says nothing (`from_generator`) pads to buckets, its batch dimension unknown.
    tf = pytest.importorskip("tensorflow")
    acc = Accelerator(**DEVICES)
    static = -(-16 // acc.num_replicas) * acc.num_replicas
    batched = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
    spec = acc.dataset(batched).element_spec
    assert [leaf.shape[0] for leaf in tf.nest.flatten(spec)] == [static] * 3
    grown = tf.data.Dataset.from_generator(
        _growing,
        output_signature=(
            tf.TensorSpec((None, X.shape[1]), tf.float32),
            tf.TensorSpec((None,) + Y.shape[1:], tf.as_dtype(Y.dtype)),
        ),
    )
    spec = acc.dataset(grown).element_spec
    assert [leaf.shape[0] for leaf in tf.nest.flatten(spec)] == [None] * 3
    rows = [int(batch[0].shape[0]) for batch in acc.dataset(grown)]
    first = -(-5 // acc.num_replicas) * acc.num_replicas
    assert rows == [bucket_rows(size, first) for size in SIZES]
