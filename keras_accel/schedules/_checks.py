"""Argument checks shared by the schedules: each error names what it received and what works."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import keras

from keras_accel.utils.checks import is_int

UNITS = ("steps", "epochs", "fraction")


def is_real(value: Any) -> bool:
    # `bool` is an `int` subclass, but `learning_rate=True` is always a mistake.
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_whole(value: Any) -> bool:
    return is_int(value)


def positive_number(name: str, value: Any) -> float:
    """A finite number > 0, e.g. a peak learning rate."""
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"`{name}` must be a finite number greater than 0. Received: {name}={value!r}"
        )
    return float(value)


def non_negative_number(name: str, value: Any) -> float:
    """A finite number >= 0, e.g. the learning rate a warmup starts from or a decay ends at."""
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`{name}` must be a finite number greater than or equal to 0. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def step_count(name: str, value: Any, *, positive: bool = False) -> int:
    """A whole number of steps, >= 0 (or > 0 when `positive`)."""
    lowest = 1 if positive else 0
    if not is_whole(value) or value < lowest:
        kind = "positive" if positive else "non-negative"
        hint = ""
        if is_real(value) and 0 < value < 1:
            hint = " For a fraction of training, use the `*_fraction` argument or unit='fraction'."
        raise ValueError(
            f"`{name}` must be a {kind} whole number of steps.{hint} Received: {name}={value!r}"
        )
    return int(value)


def optional_step_count(name: str, value: Any) -> int | None:
    return None if value is None else step_count(name, value, positive=True)


def fraction(name: str, value: Any) -> float:
    """A fraction of training, strictly between 0 and 1."""
    if not is_real(value) or not 0 < value < 1:
        raise ValueError(
            f"`{name}` must be a fraction of training strictly between 0 and 1, "
            f"e.g. 0.1 for the first 10% of steps. Received: {name}={value!r}"
        )
    return float(value)


def schedule(name: str, value: Any) -> Any:
    # Only Keras schedules: a plain function would run, but could not be saved with the model.
    if not isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
        hint = " Wrap a fixed rate in `Constant(value)`." if is_real(value) else ""
        raise ValueError(
            f"`{name}` must be a `keras.optimizers.schedules.LearningRateSchedule`, such as a "
            f"keras_accel schedule.{hint} Received: {name}={value!r} "
            f"of type {type(value).__name__}"
        )
    return value


def unit(value: Any) -> str:
    if value not in UNITS:
        raise ValueError(f"`unit` must be one of {list(UNITS)}. Received: unit={value!r}")
    return value


def learning_rates(name: str, values: Any) -> list[float]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(
            f"`{name}` must be a non-empty list of learning rates. Received: {name}={values!r}"
        )
    for index, value in enumerate(values):
        if not is_real(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"Every entry of `{name}` must be a finite learning rate greater than 0. "
                f"Received: {name}[{index}]={value!r} in {name}={list(values)!r}"
            )
    return [float(v) for v in values]


def boundaries(value: Any, unit_: str) -> list[int] | list[float]:
    """Static checks: right type for the unit, positive, strictly increasing."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"`boundaries` must be a list of numbers. Received: boundaries={value!r}")
    value = list(value)
    for index, b in enumerate(value):
        if unit_ == "steps" and not (is_whole(b) and b > 0):
            hint = ""
            if is_real(b) and not is_whole(b):
                hint = " For fractions of training pass unit='fraction'."
            raise ValueError(
                "With unit='steps', every boundary must be a positive whole number of steps."
                f"{hint} Received: boundaries[{index}]={b!r} in boundaries={value!r}"
            )
        if unit_ == "epochs" and not (is_real(b) and math.isfinite(b) and b > 0):
            raise ValueError(
                "With unit='epochs', every boundary must be a number of epochs greater than 0. "
                f"Received: boundaries[{index}]={b!r} in boundaries={value!r}"
            )
        if unit_ == "fraction" and not (is_real(b) and 0 < b < 1):
            raise ValueError(
                "With unit='fraction', every boundary must be a fraction of training strictly "
                "between 0 and 1, e.g. 0.5 for half-way. "
                f"Received: boundaries[{index}]={b!r} in boundaries={value!r}"
            )
    if any(later <= earlier for earlier, later in zip(value, value[1:])):
        raise ValueError(
            f"`boundaries` must be strictly increasing. Received: boundaries={value!r}"
        )
    if unit_ == "steps":
        return [int(b) for b in value]
    return [float(b) for b in value]


def round_steps(value: float) -> int:
    # Round half up, not Python's round-half-to-even, so that boundaries stay monotone and
    # 0.29 * 100 (= 28.999...) lands on step 29 rather than being floored to 28.
    return int(math.floor(value + 0.5))


def resolve_boundaries(
    value: list[int] | list[float],
    unit_: str,
    *,
    steps_per_epoch: int | None,
    total_steps: int | None,
) -> list[int] | None:
    """Boundaries in steps, or None while the unit still lacks the training length."""
    if unit_ == "steps":
        return list(value)
    if unit_ == "epochs":
        if steps_per_epoch is None:
            return None
        return [round_steps(b * steps_per_epoch) for b in value]
    if total_steps is None:
        return None
    # Two close fractions of a very short run may land on the same step; the value between
    # them is then skipped, which is what a run that short can honour.
    return [round_steps(b * total_steps) for b in value]
