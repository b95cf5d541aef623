"""Facts about a Keras optimizer that several layers read."""

from __future__ import annotations


def inner_optimizer(optimizer):
    """The optimizer that owns the learning rate and the update: a `LossScaleOptimizer`
    (mixed float16) delegates both to the optimizer it wraps (its public `inner_optimizer`);
    any other optimizer is its own."""
    return getattr(optimizer, "inner_optimizer", optimizer)
