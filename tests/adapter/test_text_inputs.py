"""Text in: raw strings into a model (TF), and keras-hub task models with their preprocessors."""

import importlib.util

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.data import synthetic_text_classification
from tests.helpers import assert_weights_close

WORDS = ["the", "a", "cat", "dog", "sat", "ran"]
TINY_BERT = {
    "sequence_length": 16,
    "num_layers": 1,
    "hidden_dim": 16,
    "num_heads": 2,
    "intermediate_dim": 32,
    "dropout": 0.0,  # dropout draws differ between one device and 8: compare without
}
needs_keras_hub = pytest.mark.skipif(
    importlib.util.find_spec("keras_hub") is None, reason="keras-hub is not installed"
)


def _text_model():
    vectorize = keras.layers.TextVectorization(
        max_tokens=10, output_sequence_length=4, vocabulary=WORDS
    )
    inputs = keras.Input((1,), dtype="string")
    embed = keras.layers.Embedding(
        10, 4, embeddings_initializer=keras.initializers.RandomNormal(seed=0)
    )
    pooled = keras.layers.GlobalAveragePooling1D()(embed(vectorize(inputs)))
    dense = keras.layers.Dense(
        2, activation="softmax", kernel_initializer=keras.initializers.GlorotUniform(1)
    )
    model = keras.Model(inputs, dense(pooled))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _sentences(n=100):
    rng = np.random.default_rng(0)
    x = np.array([[" ".join(rng.choice(WORDS, 3))] for _ in range(n)], dtype=object)
    y = np.array([int("cat" in s[0]) for s in x])
    return x, y


def test_string_arrays_and_tf_data_of_strings_train_exactly(backend):
    x, y = _sentences()
    acc = Accelerator()
    if backend != "tensorflow":
        with acc.scope():
            model = _text_model()
        with pytest.raises(ValueError, match=r"KERAS_BACKEND=jax cannot feed text .* object"):
            acc.fit(model, x, y, batch_size=16, verbose=0)
        return
    import tensorflow as tf

    with acc.scope():
        model = _text_model()
    twin = _text_model()
    twin.set_weights(model.get_weights())
    # numpy object arrays of str: Keras itself refuses them ("Invalid dtype: object").
    got = acc.fit(model, x, y, batch_size=16, shuffle=False, verbose=0)  # 100 = 6 x 16 + 4
    want = twin.fit(tf.constant(x.astype(str)), y, batch_size=16, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    strings = tf.data.Dataset.from_tensor_slices((x.astype(str), y)).batch(16)
    got = acc.evaluate(model, strings, verbose=0, return_dict=True)
    want = twin.evaluate(tf.constant(x.astype(str)), y, batch_size=100, verbose=0, return_dict=True)
    assert got == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(
        acc.predict(model, x, verbose=0),
        twin.predict(tf.constant(x.astype(str)), verbose=0),
        atol=1e-6,
    )


def _bert():
    from keras_accel.models import bert_classifier

    model = bert_classifier(num_classes=3, **TINY_BERT)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@needs_keras_hub
@pytest.mark.parametrize("devices", [1, None], ids=["1-device", "all-devices"])
def test_keras_hub_classifier_with_its_preprocessor_matches_plain_keras(devices):
    # The seed's model: raw strings in, keras-hub's BertTextClassifierPreprocessor run in
    # tf.data by the Accelerator (as keras-hub's own fit does), static shapes, exact.
    (x, y), (x_test, y_test) = synthetic_text_classification(50, 21, num_classes=3)
    acc = Accelerator(devices=devices)
    with acc.scope():
        model = _bert()
    twin = _bert()
    twin.set_weights(model.get_weights())
    got = acc.fit(model, x, y, batch_size=16, shuffle=False, verbose=0,
                  validation_data=(x_test, y_test))  # fmt: skip
    want = twin.fit(x, y, batch_size=16, shuffle=False, verbose=0,
                    validation_data=(x_test, y_test))  # fmt: skip
    assert_weights_close(model.get_weights(), twin.get_weights(), atol=1e-5)
    for name, values in want.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)
    got = acc.evaluate(model, x_test, y_test, verbose=0, return_dict=True)
    assert got == pytest.approx(twin.evaluate(x_test, y_test, verbose=0, return_dict=True))
    predictions = acc.predict(model, x_test, verbose=0)
    assert predictions.shape == (21, 3)
    np.testing.assert_allclose(predictions, twin.predict(x_test, verbose=0), atol=1e-5)
    assert acc.num_recompiles == 0
    # keras-hub's own fit keeps working on the model afterwards (no trace of ours).
    assert (
        np.isfinite(model.fit(x, y, batch_size=10, verbose=0).history["loss"][0])
        if (acc.num_replicas == 1)
        else True
    )
