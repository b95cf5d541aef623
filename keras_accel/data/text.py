"""A small synthetic text-classification set and its BERT vocabulary, for offline BERT runs.

The BERT seed classified real sentences with a downloaded tokenizer. Tests and benchmarks here
must run without a network, so sentences are drawn from a fixed ~100-word vocabulary: each
class owns a topic word list, and every sentence mixes its class's topic words with neutral
filler, so the label is learnable from word content (a bag-of-words model can reach 100%).
"""

from __future__ import annotations

import numpy as np

from keras_accel.utils.checks import check_count

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# One topic per class, in label order: class i's sentences contain words of TOPICS[i].
TOPICS = (
    ("goal", "team", "match", "coach", "league", "score", "player", "stadium", "referee", "win"),
    ("rain", "sunny", "cloud", "storm", "wind", "snow", "forecast", "humid", "thunder", "fog"),
    ("bread", "cheese", "soup", "pasta", "spicy", "dinner", "recipe", "salad", "oven", "sweet"),
    ("guitar", "song", "drums", "concert", "melody", "band", "piano", "album", "singer", "jazz"),
    ("train", "airport", "hotel", "ticket", "beach", "passport", "luggage", "map", "tour", "ferry"),
)
MAX_CLASSES = len(TOPICS)

# Words every class uses equally: they carry no label information.
FILLER = (
    "the", "a", "we", "they", "it", "was", "is", "very", "and", "then", "today", "yesterday",
    "some", "new", "big", "old", "with", "about", "this", "that", "my", "our", "saw", "had",
    "really", "quite", "again", "after", "before", "so",
)  # fmt: skip


def text_vocabulary() -> list[str]:
    """The WordPiece vocabulary that covers every synthetic sentence, special tokens first.

    `[PAD]` is id 0 (BERT's padding convention); then `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`,
    the full stop, the filler words and the topic words of all `MAX_CLASSES` classes. The
    list does not depend on `num_classes`, so one tokenizer serves every variant of the set.

    Returns:
        A new list of unique token strings.

    Example:
        >>> vocab = text_vocabulary()
        >>> vocab[:5]
        ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
        >>> "goal" in vocab
        True
    """
    words = [*SPECIAL_TOKENS, "."]
    for word in (*FILLER, *(w for topic in TOPICS for w in topic)):
        if word not in words:
            words.append(word)
    return words


def synthetic_text_classification(
    num_samples: int = 512,
    num_test_samples: int = 128,
    *,
    num_classes: int = 2,
    min_words: int = 4,
    max_words: int = 12,
    topic_fraction: float = 0.4,
    seed: int = 0,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Seeded sentences whose label is the topic of their content words.

    Each sentence has between `min_words` and `max_words` words and ends with " ."; each
    word is a topic word of its class with probability `topic_fraction` (at least one per
    sentence), otherwise a filler word. Labels are balanced in expectation.

    Args:
        num_samples: training sentences.
        num_test_samples: test sentences (drawn from the same distribution).
        num_classes: number of labels, 2 to `MAX_CLASSES`.
        min_words: fewest words in a sentence (at least 1).
        max_words: most words in a sentence.
        topic_fraction: probability that a word is a topic word, in (0, 1].
        seed: random seed; the same arguments always give the same data.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: `x` a 1-D numpy array of `str`, `y` int32
        class ids of shape `(n,)`.

    Example:
        >>> (x, y), (x_test, y_test) = synthetic_text_classification(8, 4)
        >>> x.shape, y.shape, x_test.shape
        ((8,), (8,), (4,))
        >>> x[0].endswith(" .")
        True
    """
    for name, value in (("num_samples", num_samples), ("num_test_samples", num_test_samples)):
        check_count(name, value)
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, int)
        or not (2 <= num_classes <= MAX_CLASSES)
    ):
        raise ValueError(
            f"`num_classes` must be an integer from 2 to {MAX_CLASSES} (one topic per class). "
            f"Received: num_classes={num_classes!r}"
        )
    if not (isinstance(min_words, int) and isinstance(max_words, int)) or not (
        1 <= min_words <= max_words
    ):
        raise ValueError(
            "`min_words` and `max_words` must be integers with 1 <= min_words <= max_words. "
            f"Received: min_words={min_words!r}, max_words={max_words!r}"
        )
    if not 0.0 < topic_fraction <= 1.0:
        raise ValueError(
            f"`topic_fraction` must be in (0, 1]. Received: topic_fraction={topic_fraction!r}"
        )

    rng = np.random.default_rng(seed)
    total = num_samples + num_test_samples
    labels = rng.integers(0, num_classes, size=total).astype("int32")
    lengths = rng.integers(min_words, max_words + 1, size=total)
    sentences = []
    for label, length in zip(labels, lengths):
        is_topic = rng.random(length) < topic_fraction
        # A sentence without a topic word would be unlearnable noise: force one.
        is_topic[rng.integers(length)] = True
        topic = TOPICS[label]
        words = [
            topic[rng.integers(len(topic))] if t else FILLER[rng.integers(len(FILLER))]
            for t in is_topic
        ]
        sentences.append(" ".join(words) + " .")
    x = np.array(sentences, dtype=str) if sentences else np.zeros((0,), dtype=str)
    return (x[:num_samples], labels[:num_samples]), (x[num_samples:], labels[num_samples:])
