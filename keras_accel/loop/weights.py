"""How sample weights fit the values they weigh, as Keras weighs them: the shape rules that
the loss (`losses.py`) and the weighted metrics (`metrics.py`) of the custom loop share."""

from __future__ import annotations

import numpy as np


def static_shape(tensor) -> tuple:
    """The static shape, an unknown (traced) size as None."""
    return tuple(None if d is None else int(d) for d in np.shape(tensor))


def fits(weights_shape: tuple, shape: tuple) -> bool:
    """Whether weights of `weights_shape` weigh values of `shape` as Keras weighs them: at
    most one axis more than the values, a trailing 1 (squeezed); each axis the values' or 1
    (broadcast), the values' axes beyond the weights' rank taking each weight whole. Unknown
    (traced) sizes fit."""
    if len(weights_shape) > len(shape):
        if len(weights_shape) > len(shape) + 1 or weights_shape[-1] != 1:
            return False
        weights_shape = weights_shape[:-1]
    return all(w in (None, 1) or v is None or w == v for w, v in zip(weights_shape, shape))


def to_rank(weights, rank: int):
    """Weights of a loss per step, `(rows, steps)`, brought to the loss's rank as Keras
    does: a trailing axis of 1 squeezed, or axes of 1 appended (`(rows, 1)` broadcasts)."""
    from keras import ops

    while len(weights.shape) > rank and weights.shape[-1] == 1:
        weights = ops.squeeze(weights, axis=-1)
    if len(weights.shape) < rank:
        weights = ops.reshape(weights, tuple(weights.shape) + (1,) * (rank - len(weights.shape)))
    return weights
