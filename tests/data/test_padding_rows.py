"""What a padding row holds: copies of a real row, never values user code could not see.

A model sees padding rows before any weight can take them out. Rows of zeros made a `log`
of the input -inf there, and 0 times inf is a NaN in the weighted loss: the whole step's
gradient NaN, silently, where plain Keras (which never pads) trains. Each input kind pads
its own way (numpy, tf.data's graph, a stream padded as it comes); each is run here.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from keras_accel.data.batching import pad_batch, padding_like, same_rows
from tests.helpers import FEW_REPLICAS


class Log(keras.layers.Layer):
    """A layer whose output is -inf on a row of zeros (as `ops.log` of a raw count)."""

    def call(self, x):
        return ops.log(x)


def _model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            Log(),
            keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(0)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(1)),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data(n=21):
    rng = np.random.default_rng(0)
    x = rng.uniform(1.0, 2.0, size=(n, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


class _Rows(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i):
        rows = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def _inputs(kind, x, y, batch_size):
    if kind == "arrays":
        return dict(x=x, y=y, batch_size=batch_size)
    if kind == "pydataset":
        return dict(x=_Rows(x, y, batch_size))
    if kind == "generator":

        def rows():
            while True:
                for start in range(0, len(x), batch_size):
                    yield x[start : start + batch_size], y[start : start + batch_size]

        return dict(x=rows(), steps_per_epoch=-(-len(x) // batch_size))
    import tensorflow as tf

    return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size))


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["arrays", "pydataset", "generator", "tf.data"])
def test_a_model_that_cannot_take_zeros_trains_as_plain_keras(kind, backend, num_devices):
    if kind == "tf.data" and backend != "tensorflow":
        pytest.skip("tf.data is TensorFlow's input")
    devices = FEW_REPLICAS if backend == "tensorflow" else num_devices
    acc = Accelerator(seed=0, devices=devices)
    x, y = _data()
    batch = 10  # 21 rows: a last batch of 1, padded (to the replica count, or to 10).
    with acc.scope():
        model = _model()
    twin = _model()
    twin.set_weights(model.get_weights())
    want = twin.fit(**_inputs(kind, x, y, batch), epochs=2, shuffle=False, verbose=0)
    got = acc.fit(model, **_inputs(kind, x, y, batch), epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(got.history["loss"]).all(), got.history
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if kind in ("arrays", "tf.data"):
        want = twin.evaluate(x, y, batch_size=batch, verbose=0)
        got = acc.evaluate(model, x, y, batch_size=batch, verbose=0)
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_padding_rows_are_copies_of_a_real_row_weighted_zero():
    x = {"n": np.arange(6, dtype="float32").reshape(3, 2), "s": np.array(["a", "b", "c"])}
    px, py, sw, mask = pad_batch(x, np.array([1, 2, 3]), np.array([1.0, 2.0, 3.0]), rows=6)
    np.testing.assert_array_equal(px["n"][3:], [[4, 5]] * 3)
    np.testing.assert_array_equal(px["s"], ["a", "b", "c", "c", "c", "c"])
    np.testing.assert_array_equal(py, [1, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(sw, [1, 2, 3, 0, 0, 0])
    np.testing.assert_array_equal(mask, [1, 1, 1, 0, 0, 0])
    # A process whose data has ended feeds real values, weighted and masked 0.
    qx, qy, qsw, qmask = padding_like((px, py, sw, mask))
    np.testing.assert_array_equal(qx["s"], px["s"])
    np.testing.assert_array_equal(qsw, 0)
    np.testing.assert_array_equal(qmask, 0)


def test_a_group_of_batches_in_different_buckets_pads_as_a_batch_does():
    from keras_accel.data.batching import pack, unpack

    small = pack(*pad_batch(np.ones((2, 2), "float32"), np.array([1, 2]), None, rows=2), cut=0)
    large = pack(*pad_batch(np.zeros((3, 2), "float32"), np.array([5, 6, 7]), None, rows=4))
    large = pack(*unpack(large), cut=0)
    grown, same = same_rows([small, large])
    assert same is large
    x, y, sw, mask = unpack(grown)
    np.testing.assert_array_equal(x, np.ones((4, 2)))  # Copies of a real row.
    np.testing.assert_array_equal(y, [1, 2, 2, 2])
    np.testing.assert_array_equal(sw, [1, 1, 0, 0])
    np.testing.assert_array_equal(mask, [1, 1, 0, 0])
    assert len(grown) == len(large) and len(grown[2]) == 3  # The cut marker is kept.
