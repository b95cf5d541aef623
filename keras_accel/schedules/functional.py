"""Pure schedule math: `step -> learning rate` functions written with `keras.ops`.

Every function takes the step (a Python number, a NumPy array or a backend tensor, scalar or
not) plus keyword parameters in steps, and returns a float32 tensor of the step's shape. They
contain no Python control flow on the step, so they trace under `jax.jit` and `tf.function`
and evaluate a whole array of steps at once. The classes in `keras_accel.schedules` validate
their arguments and then call these; the functions only guard against division by zero.

Example:

>>> import numpy as np
>>> from keras import ops
>>> from keras_accel.schedules import functional
>>> values = functional.cosine_decay(np.arange(5), init_value=1.0, end_value=0.0, decay_steps=4)
>>> [round(float(value), 4) for value in ops.convert_to_numpy(values)]
[1.0, 0.8536, 0.5, 0.1464, 0.0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from keras import ops

__all__ = [
    "as_step",
    "constant",
    "cosine_decay",
    "exponential_decay",
    "join",
    "linear_decay",
    "linear_warmup",
    "piecewise_constant",
]


def _to_float32(x: Any) -> Any:
    return ops.cast(ops.convert_to_tensor(x), "float32")


def as_step(step: Any) -> Any:
    """The step as a float32 tensor (exact for steps below 2**24, about 16.7 million)."""
    return _to_float32(step)


def _require_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"`{name}` must be greater than 0. Received: {name}={value!r}")


def constant(step: Any, *, value: float) -> Any:
    """`value` at every step."""
    return ops.full_like(as_step(step), value)


def piecewise_constant(step: Any, *, values: Sequence[float], boundaries: Sequence[int]) -> Any:
    """`values[i]` from step `boundaries[i - 1]` (inclusive) up to step `boundaries[i]`.

    The value changes *at* each boundary: with `boundaries=[50]`, steps 0..49 get `values[0]`
    and steps 50 onwards get `values[1]`.
    """
    if len(values) != len(boundaries) + 1:
        raise ValueError(
            "`values` must have one more entry than `boundaries`. "
            f"Received: values={list(values)}, boundaries={list(boundaries)}"
        )
    step = as_step(step)
    result = ops.full_like(step, values[0])
    for boundary, value in zip(boundaries, values[1:]):
        result = ops.where(step >= boundary, ops.full_like(step, value), result)
    return result


def exponential_decay(
    step: Any,
    *,
    init_value: float,
    decay_steps: int,
    decay_rate: float,
    staircase: bool = False,
    end_value: float | None = None,
) -> Any:
    """`init_value * decay_rate ** (step / decay_steps)`, never below `end_value`.

    With `staircase=True` the exponent is `floor(step / decay_steps)`, so the rate drops in
    steps of `decay_rate` every `decay_steps` steps.
    """
    _require_positive("decay_steps", decay_steps)
    _require_positive("decay_rate", decay_rate)
    step = as_step(step)
    progress = ops.maximum(step, 0.0) / float(decay_steps)
    if staircase:
        progress = ops.floor(progress)
    # exp(p * log(r)) rather than power(r, p): one well-defined float32 op on every backend.
    result = init_value * ops.exp(progress * math.log(decay_rate))
    if end_value is not None:
        result = ops.maximum(result, end_value)
    return result


def _progress(step: Any, steps: int) -> Any:
    """Fraction of `steps` done, clipped to [0, 1] so that before and after are flat."""
    return ops.clip(as_step(step) / float(steps), 0.0, 1.0)


def linear_decay(step: Any, *, init_value: float, end_value: float, decay_steps: int) -> Any:
    """Straight line from `init_value` at step 0 to `end_value` at `decay_steps`, then flat."""
    _require_positive("decay_steps", decay_steps)
    return init_value + (end_value - init_value) * _progress(step, decay_steps)


def cosine_decay(step: Any, *, init_value: float, end_value: float, decay_steps: int) -> Any:
    """Half a cosine from `init_value` at step 0 to `end_value` at `decay_steps`, then flat.

    `end_value + (init_value - end_value) * (1 + cos(pi * t)) / 2`, with
    `t = min(step, decay_steps) / decay_steps`.
    """
    _require_positive("decay_steps", decay_steps)
    cosine = 0.5 * (1.0 + ops.cos(math.pi * _progress(step, decay_steps)))
    return end_value + (init_value - end_value) * cosine


def linear_warmup(step: Any, *, init_value: float, peak_value: Any, warmup_steps: int) -> Any:
    """Straight line from `init_value` at step 0 to `peak_value` at `warmup_steps`, then flat.

    `peak_value` may be a tensor, e.g. the value the schedule after the warmup starts from.
    """
    _require_positive("warmup_steps", warmup_steps)
    return init_value + (peak_value - init_value) * _progress(step, warmup_steps)


def join(
    step: Any,
    *,
    schedules: Sequence[Callable[[Any], Any]],
    boundaries: Sequence[int],
) -> Any:
    """`schedules[i]` from step `boundaries[i - 1]` on, each restarted at its own step 0.

    Like `optax.join_schedules`: schedule `i > 0` is called with `step - boundaries[i - 1]`, so
    each piece can be written as if it started training. Every piece is evaluated and the right
    one selected, which keeps the function free of control flow on the step.
    """
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            "`schedules` must have one more entry than `boundaries`. "
            f"Received: {len(schedules)} schedules, boundaries={list(boundaries)}"
        )
    step = as_step(step)
    result = _to_float32(schedules[0](step))
    for boundary, schedule in zip(boundaries, schedules[1:]):
        result = ops.where(step >= boundary, _to_float32(schedule(step - boundary)), result)
    return result
