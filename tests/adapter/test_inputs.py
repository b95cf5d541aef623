"""Every input kind the Accelerator takes: arrays, dicts, PyDataset, tf.data."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import (
    FEW_REPLICAS,
    Batches,
    assert_weights_close,
    compiled_mlp,
    data,
    mlp,
    unpadded_remainder,
)


def _pair(acc):
    with acc.scope():
        model = compiled_mlp()
    twin = compiled_mlp()
    twin.set_weights(model.get_weights())
    return model, twin


def test_pydataset_with_partial_last_batch_trains_and_evaluates_exactly():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, twin = _pair(acc)
    x, y = data(43)
    acc.fit(model, Batches(x, y, 16), epochs=1, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    got = acc.evaluate(model, Batches(x, y, 16), verbose=0)
    want = twin.evaluate(x, y, batch_size=43, verbose=0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert acc.predict(model, Batches(x, y, 16), verbose=0).shape == (43, 3)


def test_tf_data_input_is_padded_in_the_graph():
    tf = pytest.importorskip("tensorflow")
    acc = Accelerator(devices=FEW_REPLICAS)
    model, twin = _pair(acc)
    x, y = data(43)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    acc.fit(model, dataset, epochs=1, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    got = acc.evaluate(model, dataset, verbose=0)
    np.testing.assert_allclose(got, twin.evaluate(x, y, batch_size=43, verbose=0), rtol=1e-5)
    predictions = acc.predict(model, tf.data.Dataset.from_tensor_slices(x).batch(16), verbose=0)
    np.testing.assert_allclose(predictions, np.asarray(twin(x)), atol=1e-6)


def test_dataset_inputs_refuse_batch_size_and_targets():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, _ = _pair(acc)
    x, y = data(16)
    with pytest.raises(ValueError, match="Received also: batch_size"):
        acc.fit(model, Batches(x, y, 8), batch_size=8, verbose=0)


def test_dict_inputs_and_two_input_model():
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
        merged = keras.layers.Concatenate()([a, b])
        out = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(merged))
        model = keras.Model({"a": a, "b": b}, out)
        model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = {
        "a": rng.normal(size=(50, 3)).astype("float32"),
        "b": rng.normal(size=(50, 2)).astype("float32"),
    }
    y = rng.normal(size=(50, 1)).astype("float32")
    history = acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert acc.predict(model, x, batch_size=16, verbose=0).shape == (50, 1)


def test_validation_split_takes_the_last_rows_like_keras():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, twin = _pair(acc)
    x, y = data(50)
    history = acc.fit(
        model, x, y, batch_size=8, epochs=1, validation_split=0.2, verbose=0, shuffle=False
    )
    twin.fit(x[:40], y[:40], batch_size=8, epochs=1, shuffle=False, verbose=0)
    want = twin.evaluate(x[40:], y[40:], batch_size=10, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][0], want[0], rtol=1e-5)
    with pytest.raises(ValueError, match="validation_split must be in \\(0, 1\\)"):
        acc.fit(model, x, y, batch_size=8, validation_split=1.5, verbose=0)


@pytest.mark.parametrize("kind", ["arrays", "pydataset", "tf.data", "tf.data one-hot"])
@pytest.mark.parametrize("class_weight", [{0: 0.5, 1: 2.0, 2: 1.0}, {1: 3.0}])
def test_class_weight_matches_keras(kind, class_weight):
    """`class_weight` on every input Keras takes it with; a class it does not name weighs
    1.0, as in Keras (`{1: 3.0}` weights class 1 up). 43 rows: the last batch is partial."""
    acc = Accelerator(devices=FEW_REPLICAS)
    model, twin = _pair(acc)
    x, y = data(43)
    if kind == "arrays":
        given = dict(x=x, y=y, batch_size=16)
    elif kind == "pydataset":
        given = dict(x=Batches(x, y, 16))
    else:
        tf = pytest.importorskip("tensorflow")
        targets = np.eye(3, dtype="float32")[y] if kind == "tf.data one-hot" else y
        given = dict(x=tf.data.Dataset.from_tensor_slices((x, targets)).batch(16))
        if kind == "tf.data one-hot":
            with acc.scope():
                model = mlp()
                model.compile("sgd", "categorical_crossentropy")
            twin = mlp()
            twin.compile("sgd", "categorical_crossentropy")
            twin.set_weights(model.get_weights())
            y = targets
    acc.fit(model, **given, epochs=1, class_weight=class_weight, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=1, class_weight=class_weight, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_class_weight_refusals_say_what_works():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, _ = _pair(acc)
    x, y = data(16)
    generator = ((x[i : i + 8], y[i : i + 8]) for i in (0, 8))
    with pytest.raises(ValueError, match="not supported for Python generator inputs"):
        acc.fit(model, generator, class_weight={0: 2.0}, verbose=0)

    class WithWeights(Batches):
        def __getitem__(self, index):
            xb, yb = super().__getitem__(index)
            return xb, yb, np.ones(len(xb), "float32")

    with pytest.raises(ValueError, match="cannot `class_weight` and `sample_weight`"):
        acc.fit(model, WithWeights(x, y, 8), class_weight={0: 2.0}, verbose=0)
    with pytest.raises(ValueError, match="keys must be class indices"):
        acc.fit(model, x, y, batch_size=8, class_weight={"a": 2.0}, verbose=0)


def test_targetless_training_of_a_model_whose_loss_needs_targets_is_a_clear_error():
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((20, 4), "float32")
    with pytest.raises(ValueError, match=r"compiled with a loss.*Received: y=None"):
        acc.fit(model, x, batch_size=8, verbose=0)


def _add_loss_model():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(0)),
            keras.layers.ActivityRegularization(l2=0.5),
        ]
    )
    model.compile(optimizer="sgd")  # The only loss is the layer's own (add_loss).
    return model


def test_targetless_training_drops_the_partial_batch_with_a_note_and_matches_keras():
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = _add_loss_model()
    twin = _add_loss_model()
    twin.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(20, 4)).astype("float32")
    with pytest.warns(UserWarning, match=r"no targets .* \(4 of 20 rows"):
        acc.fit(model, x, batch_size=8, shuffle=False, verbose=0)
    # Padding rows would count in the layer's loss: the last 4 rows run unpadded, as a batch
    # of 4 (one replica; JAX), or are dropped (several TensorFlow replicas).
    rows = x if unpadded_remainder(acc) else x[:16]
    twin.fit(rows, batch_size=8, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    indivisible = Accelerator(devices=FEW_REPLICAS, remainder="drop")
    with indivisible.scope():
        model = _add_loss_model()
    if indivisible.num_replicas > 1:
        with pytest.raises(ValueError, match="no targets .* need padding rows in every batch"):
            indivisible.fit(model, x, batch_size=indivisible.num_replicas + 1, verbose=0)


def test_unsupported_input_type_names_what_works():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, _ = _pair(acc)
    with pytest.raises(TypeError, match="Supported inputs: numpy arrays"):
        acc.fit(model, object(), np.zeros(4), batch_size=8, verbose=0)


def test_dataset_method_feeds_plain_model_fit():
    # Without BatchNormalization the padded batches' zero weights make a plain model.fit
    # exact (BatchNormalization over real rows needs acc.fit, which knows the row mask).
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = compiled_mlp(batchnorm=False)
    twin = compiled_mlp(batchnorm=False)
    twin.set_weights(model.get_weights())
    x, y = data(30)
    dataset = acc.dataset(x, y, batch_size=8)
    with acc.scope():
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    twin.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    # Keras's own (x, y, sample_weight) batches: the last one's 2 padding rows weighted 0.
    batches = (
        [dataset[i] for i in range(len(dataset))]
        if hasattr(dataset, "__getitem__")
        else list(dataset)
    )
    last_x, _, last_w = batches[-1]
    assert np.asarray(last_x).shape[0] == 8
    np.testing.assert_array_equal(np.asarray(last_w)[6:], 0.0)


def test_lists_of_inputs_and_targets_work_as_in_keras():
    # `x=[a, b, c]` and `y=[y1, y2]` as Python lists, which Keras takes as tuples (on
    # TensorFlow tf.data would read a list as one stacked tensor).
    def build():
        inputs = [keras.Input((3,), name=name) for name in "abc"]
        hidden = keras.layers.Concatenate()(inputs)
        outputs = [
            keras.layers.Dense(1, name="o1")(hidden),
            keras.layers.Dense(2, name="o2")(hidden),
        ]
        model = keras.Model(inputs, outputs)
        model.compile("sgd", ["mse", "mse"], metrics=[["mae"], ["mae"]])
        return model

    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = build()
    twin = build()
    twin.set_weights(model.get_weights())
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(8, 3)).astype("float32") for _ in range(3)]
    y = [rng.normal(size=(8, 1)).astype("float32"), rng.normal(size=(8, 2)).astype("float32")]
    history = acc.fit(model, x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    expected = twin.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    logs = acc.evaluate(model, x, y, batch_size=4, verbose=0, return_dict=True)
    assert logs == pytest.approx(twin.evaluate(x, y, batch_size=4, verbose=0, return_dict=True))
    for ours, theirs in zip(acc.predict(model, x, batch_size=4, verbose=0), twin.predict(x)):
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_sparse_inputs_are_densified_and_ragged_ones_refused_with_what_works(backend):
    # Keras takes SciPy sparse matrices, tf.SparseTensor and (JAX) BCOO; every batch here is
    # padded to a static shape, so they are densified: the same values, the same results.
    import scipy.sparse
    import tensorflow as tf

    rng = np.random.default_rng(0)
    dense = (rng.random((10, 4)) * (rng.random((10, 4)) > 0.5)).astype("float32")
    y = rng.random((10, 3)).astype("float32")

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile("sgd", "mse", metrics=["mae"])
        return model

    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = build()
    twin = build()
    twin.set_weights(model.get_weights())
    acc.fit(model, scipy.sparse.csr_matrix(dense), y, batch_size=4, shuffle=False, verbose=0)
    twin.fit(dense, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())

    def batches():  # tf.SparseTensor batches from a generator (on TF: read in tf.data's thread)
        return ((tf.sparse.from_dense(dense[i : i + 4]), y[i : i + 4]) for i in range(0, 10, 4))

    acc.fit(model, batches(), verbose=0)
    twin.fit(dense, y, batch_size=4, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    expected = twin.evaluate(dense, y, batch_size=4, verbose=0, return_dict=True)
    logs = acc.evaluate(model, batches(), verbose=0, return_dict=True)
    assert logs == pytest.approx(expected)
    sparse_x = tf.sparse.from_dense(dense)
    if backend == "jax":
        from jax.experimental import sparse as jax_sparse

        sparse_x = jax_sparse.BCOO.fromdense(dense)
    logs = acc.evaluate(model, sparse_x, y, batch_size=4, verbose=0, return_dict=True)
    assert logs == pytest.approx(expected)
    np.testing.assert_allclose(
        acc.predict(model, sparse_x, batch_size=4, verbose=0), twin.predict(dense), atol=1e-6
    )
    with pytest.raises(TypeError, match=r"`x` is a tf.RaggedTensor.*to_tensor\(\)"):
        acc.fit(model, tf.ragged.constant([[1.0], [2.0, 3.0]]), y[:2], verbose=0)
