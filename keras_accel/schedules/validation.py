"""Check what an arbitrary schedule returned before it reaches an optimizer."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from keras import ops


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    suffix = f", shape {tuple(shape)}" if shape is not None else ""
    return f"{value!r} (type {type(value).__name__}{suffix})"


def validate_learning_rate(value: Any, step: int, *, name: str | None = None) -> float:
    """Check one learning rate computed by a schedule and return it as a Python float.

    Accepts a Python or NumPy number, or a one-element tensor of any backend, that is finite
    and >= 0. Anything else raises a `ValueError` that names the step and the value, so a bad
    user schedule fails loudly at the step where it went wrong, not as NaN weights later.

    Args:
        value: what the schedule returned.
        step: the step it was evaluated at, for the message.
        name: what produced `value` (e.g. the schedule's repr), for the message.

    Returns:
        The learning rate as a `float`.

    Raises:
        ValueError: if `value` is not a single real number, or is NaN, infinite or negative.

    Example:

    >>> from keras_accel.schedules import validate_learning_rate
    >>> validate_learning_rate(0.5, step=3)
    0.5
    """
    source = f"The learning-rate schedule {name}" if name else "The learning-rate schedule"
    array = None
    if value is not None and not isinstance(value, (bool, str, bytes)):
        try:
            array = np.asarray(ops.convert_to_numpy(value) if ops.is_tensor(value) else value)
        except (TypeError, ValueError):
            array = None
    # Kind b/i/u/f: bools are excluded on purpose, as `True` is not a learning rate.
    if array is None or array.dtype.kind not in "iuf" or array.size != 1:
        raise ValueError(
            f"{source} returned a value that is not one number at step {step}. A schedule "
            "must return a single float (a Python or NumPy number, or a one-element tensor). "
            f"Received: value={_describe(value)}, step={step}"
        )
    number = float(array.reshape(()))
    if not math.isfinite(number):
        raise ValueError(
            f"{source} returned {number} at step {step}. A learning rate must be finite; "
            "look for a division by zero or an overflow in the schedule. "
            f"Received: value={_describe(value)}, step={step}"
        )
    if number < 0:
        raise ValueError(
            f"{source} returned a negative learning rate at step {step}, which would make the "
            f"optimizer climb the loss. Received: value={_describe(value)}, step={step}"
        )
    return number


def evaluate_learning_rate(schedule: Callable[[int], Any], step: int) -> float:
    """Call `schedule(step)` once and return the checked learning rate as a float.

    The schedule is called exactly once with the step only: an error raised inside it,
    `TypeError` included, propagates unchanged instead of triggering a retry with other
    arguments (the trap of `keras.callbacks.LearningRateScheduler`).

    Args:
        schedule: any callable `step -> learning rate`, e.g. a keras_accel schedule or a plain
            Python function.
        step: the optimizer step, 0 for the first update.

    Returns:
        The learning rate as a `float`.

    Raises:
        ValueError: as `validate_learning_rate`, or from a keras_accel schedule that still
            needs `total_steps`.

    Example:

    >>> from keras_accel.schedules import evaluate_learning_rate
    >>> evaluate_learning_rate(lambda step: 0.1 * 0.5**step, step=2)
    0.025
    """
    value = schedule(step)
    return validate_learning_rate(value, step, name=_name(schedule))


def _name(schedule: Any) -> str:
    if hasattr(schedule, "get_config") or not hasattr(schedule, "__name__"):
        return repr(schedule)
    return schedule.__name__
