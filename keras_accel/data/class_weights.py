"""Class weights as Keras computes them: each row weighted by its class (the argmax of one-hot
targets, else the rounded target), a class the dict does not name weighing 1.0. Numpy only;
`keras_accel.data.tf_datasets.class_weighted` does the same in a tf.data graph.
"""

from __future__ import annotations

import numpy as np


def class_weights_to_sample_weights(y: np.ndarray, class_weight: dict) -> np.ndarray:
    """Per-row weights from a `{class_index: weight}` dict, as Keras computes them: the class
    is the argmax of one-hot targets, else the (rounded) target; a class the dict does not
    name weighs 1.0 (so `{1: 5.0}` weights class 1 up and leaves the others)."""
    if y is None or isinstance(y, (dict, list, tuple)):
        raise ValueError(
            "`class_weight` is only supported for Models with a single output: it needs a "
            f"single array of targets. Received: y of type {type(y).__name__}."
        )
    check_class_weight(class_weight)
    y = np.asarray(y)
    if y.ndim > 1 and y.shape[-1] > 1:
        labels = np.argmax(y, axis=-1)
    else:
        labels = np.round(y.reshape(len(y))).astype("int64")
    table = class_weight_table(class_weight)
    inside = (labels >= 0) & (labels < len(table))
    return np.where(inside, table[np.clip(labels, 0, len(table) - 1)], 1.0).astype("float32")


def check_class_weight(class_weight) -> None:
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(
            "`class_weight` must be a non-empty dict mapping class indices to weights. "
            f"Received: class_weight={class_weight!r}"
        )
    keys = [key for key in class_weight if not isinstance(key, (int, np.integer)) or key < 0]
    if keys:
        raise ValueError(
            "`class_weight` keys must be class indices (integers >= 0). "
            f"Received: class_weight={class_weight!r}"
        )


def class_weight_table(class_weight: dict) -> np.ndarray:
    """Weights by class index up to the largest key; a class not named weighs 1.0."""
    table = np.ones(max(int(key) for key in class_weight) + 1, "float32")
    for key, weight in class_weight.items():
        table[int(key)] = weight
    return table


def class_weighted_batch(batch: tuple, class_weight: dict | None, where: str) -> tuple:
    """A user's `(x, y, sample_weight)` batch with `class_weight` as its sample weights."""
    if class_weight is None:
        return batch
    x, y, sample_weight = batch
    if sample_weight is not None:
        raise ValueError(
            "You cannot `class_weight` and `sample_weight` at the same time. Received: "
            f"class_weight={class_weight} and sample weights in {where} of the data set."
        )
    return x, y, class_weights_to_sample_weights(y, class_weight)
