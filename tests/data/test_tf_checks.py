"""A tf.data.Dataset as Keras takes it: batched by its pipeline, with its targets inside, and
`batch_size`, `y` or `sample_weight` refused with what this data set needs (issue 34).
Every error comes before anything is compiled or trained."""

import keras
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from keras_accel import Accelerator  # noqa: E402
from keras_accel.data import tf_checks  # noqa: E402
from tests.helpers import FEW_REPLICAS  # noqa: E402

ROWS = 40


@pytest.fixture(scope="module")
def acc_and_model():
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = keras.Sequential(
            [keras.Input((6, 6, 1)), keras.layers.Flatten(), keras.layers.Dense(3)]
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return acc, model


def _images():
    rng = np.random.default_rng(0)
    return rng.random((ROWS, 6, 6, 1), dtype=np.float32), rng.integers(0, 3, ROWS)


def test_a_batched_data_set_with_batch_size_is_told_to_drop_it(acc_and_model):
    acc, model = acc_and_model
    x, y = _images()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.raises(ValueError, match="`batch_size` should not be passed") as raised:
        acc.fit(model, dataset, batch_size=16, verbose=0)
    message = str(raised.value)
    assert "of 16 rows" in message and "Received: batch_size=16" in message, message
    assert "_BatchDataset" not in message and "not batched" not in message, message


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_an_unbatched_data_set_is_told_to_batch_with_or_without_batch_size(acc_and_model, call):
    acc, model = acc_and_model
    x, y = _images()
    dataset = tf.data.Dataset.from_tensor_slices((x, y))  # (6, 6, 1) images, scalar labels.
    with pytest.raises(ValueError, match=r"not batched.*y has no first dimension") as raised:
        getattr(acc, call)(model, dataset, batch_size=8, verbose=0)
    assert "pass dataset.batch(8) instead. Received: batch_size=8" in str(raised.value)
    # As the advice was before: without batch_size, the same data set is refused as clearly
    # (the image's 6 rows were read as a batch's, then the graph failed on the labels).
    with pytest.raises(ValueError, match=r"not batched: .*pass dataset\.batch\(batch_size\)"):
        getattr(acc, call)(model, dataset, verbose=0)


def test_parts_of_different_first_dimensions_are_not_a_batch(acc_and_model):
    acc, model = acc_and_model
    x, y = _images()
    one_hot = np.eye(3, dtype="float32")[y]  # (3,) per example, beside a (6, 6, 1) image.
    dataset = tf.data.Dataset.from_tensor_slices((x, one_hot))
    with pytest.raises(ValueError, match=r"first dimensions .* differ \(x 6, y 3\)"):
        acc.fit(model, dataset, verbose=0)


def test_targets_and_weights_beside_a_data_set_get_keras_words(acc_and_model):
    acc, model = acc_and_model
    x, y = _images()
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(8)
    with pytest.raises(ValueError, match="`y` should not be passed. Instead, the targets"):
        acc.fit(model, dataset, y, verbose=0)
    with pytest.raises(ValueError, match="`sample_weight` should not be passed"):
        acc.evaluate(model, dataset, sample_weight=np.ones(ROWS), verbose=0)


def test_which_pipelines_may_hold_single_examples():
    x, y = _images()
    slices = tf.data.Dataset.from_tensor_slices((x, y.astype("float32")[:, None]))
    assert tf_checks.maybe_unbatched(slices.map(lambda a, b: (a[0], b)))  # (6, 1) and (1,).
    assert not tf_checks.maybe_unbatched(slices.batch(8))
    assert not tf_checks.maybe_unbatched(slices.batch(8, drop_remainder=True))  # Fixed rows.
    assert not tf_checks.maybe_unbatched(slices.batch(8).unbatch().batch(4))
    assert not tf_checks.maybe_unbatched(tf.data.Dataset.from_tensors((x, y)))  # One batch.
    generated = tf.data.Dataset.from_generator(
        lambda: iter([]), output_signature=tf.TensorSpec((8, 6, 6, 1), tf.float32)
    )
    assert not tf_checks.maybe_unbatched(generated)  # The user's generator yields batches.
    # Such a pipeline given a batch_size is one its user meant to batch: said so.
    with pytest.raises(ValueError, match=r"not batched \(no step of its pipeline batches"):
        tf_checks.check_arguments(tf.data.Dataset.from_tensor_slices(x), None, 8, None)
