"""The synthetic text set is seeded, covered by its vocabulary, and learnable from word content."""

import numpy as np
import pytest

from keras_accel.data.text import (
    FILLER,
    MAX_CLASSES,
    TOPICS,
    synthetic_text_classification,
    text_vocabulary,
)

try:
    # At collection: keras-hub imports TensorFlow, whose first import sets environment
    # variables that the conftest leak guard would otherwise blame on a test.
    import keras_hub
except ImportError:
    keras_hub = None


def test_vocabulary_has_bert_special_tokens_first_and_no_duplicates():
    vocab = text_vocabulary()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(vocab) == len(set(vocab))
    assert vocab is not text_vocabulary()  # callers may extend their copy


def test_shapes_dtypes_and_seed():
    (x, y), (x_test, y_test) = synthetic_text_classification(40, 10, num_classes=3, seed=4)
    assert x.shape == (40,) and y.shape == (40,) and x_test.shape == (10,)
    assert x.dtype.kind == "U" and y.dtype == np.int32
    assert set(np.unique(np.concatenate([y, y_test]))) <= {0, 1, 2}
    (x_again, y_again), _ = synthetic_text_classification(40, 10, num_classes=3, seed=4)
    np.testing.assert_array_equal(x, x_again)
    np.testing.assert_array_equal(y, y_again)
    (x_other, _), _ = synthetic_text_classification(40, 10, num_classes=3, seed=5)
    assert not np.array_equal(x, x_other)


def test_every_word_is_in_the_vocabulary_and_lengths_are_bounded():
    vocab = set(text_vocabulary())
    (x, _), _ = synthetic_text_classification(200, 0, num_classes=MAX_CLASSES, max_words=6)
    for sentence in x:
        words = sentence.split()
        assert set(words) <= vocab
        assert words[-1] == "." and 4 <= len(words) - 1 <= 6


def test_label_is_the_topic_of_the_content_words():
    (x, y), _ = synthetic_text_classification(300, 0, num_classes=4)
    for sentence, label in zip(x, y):
        words = set(sentence.split())
        topics = {c for c, topic in enumerate(TOPICS) if words & set(topic)}
        assert topics == {label}  # a bag-of-words rule classifies every sentence
        assert words - set(TOPICS[label]) <= {*FILLER, "."}
    assert np.bincount(y, minlength=4).min() > 40  # roughly balanced


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"num_classes": MAX_CLASSES + 1}, "num_classes"),
        ({"num_samples": -1}, "num_samples"),
        ({"min_words": 5, "max_words": 4}, "min_words"),
        ({"topic_fraction": 0.0}, "topic_fraction"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthetic_text_classification(**kwargs)


@pytest.mark.skipif(keras_hub is None, reason="keras-hub not installed")
def test_bert_tokenizer_knows_every_word():
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=text_vocabulary(), lowercase=True)
    (x, _), _ = synthetic_text_classification(32, 0, num_classes=MAX_CLASSES)
    ids = tokenizer(list(x))
    unknown = tokenizer.token_to_id("[UNK]")
    assert all(unknown not in np.asarray(row).tolist() for row in ids)
