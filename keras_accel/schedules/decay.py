"""Smooth decays: exponential, and cosine or linear decays that end with training."""

from __future__ import annotations

from typing import Any

import keras

from keras_accel.schedules import _checks, functional
from keras_accel.schedules.base import Schedule


@keras.saving.register_keras_serializable(package="keras_accel")
class ExponentialDecay(Schedule):
    """Multiply the learning rate by `decay_rate` every `decay_steps` steps.

    `value(step) = max(init_value * decay_rate ** (step / decay_steps), end_value)`; with
    `staircase=True` the exponent is rounded down, so the rate drops in discrete steps.

    Args:
        init_value: the learning rate at step 0, > 0.
        decay_steps: the number of steps over which the rate is multiplied by `decay_rate`, > 0.
        decay_rate: the factor, in (0, 1].
        staircase: decay in discrete drops instead of continuously.
        end_value: a floor the rate never goes below, in [0, init_value); `None` for none.
        total_steps: the number of training steps; not needed, kept for a uniform interface.

    Example: halve the rate every 10 steps.

    >>> from keras_accel.schedules import ExponentialDecay
    >>> schedule = ExponentialDecay(1.0, decay_steps=10, decay_rate=0.5, staircase=True)
    >>> [float(schedule(step)) for step in (0, 9, 10, 25)]
    [1.0, 1.0, 0.5, 0.25]
    """

    def __init__(
        self,
        init_value: float,
        decay_steps: int,
        decay_rate: float,
        *,
        staircase: bool = False,
        end_value: float | None = None,
        total_steps: int | None = None,
    ):
        self._init_value = _checks.positive_number("init_value", init_value)
        self._decay_steps = _checks.step_count("decay_steps", decay_steps, positive=True)
        if not _checks.is_real(decay_rate) or not 0 < decay_rate <= 1:
            raise ValueError(
                "`decay_rate` must be in (0, 1]: the factor the learning rate is multiplied by "
                f"every `decay_steps` steps. Received: decay_rate={decay_rate!r}"
            )
        self._decay_rate = float(decay_rate)
        if not isinstance(staircase, bool):
            raise ValueError(
                f"`staircase` must be True or False. Received: staircase={staircase!r}"
            )
        self._staircase = staircase
        self._end_value = None
        if end_value is not None:
            self._end_value = _checks.non_negative_number("end_value", end_value)
            if self._end_value >= self._init_value:
                raise ValueError(
                    "`end_value` is the floor the decay stops at and must be below `init_value`."
                    f" Received: init_value={init_value!r}, end_value={end_value!r}"
                )
        super().__init__(total_steps=total_steps)

    def _arguments(self) -> dict[str, Any]:
        return {
            "init_value": self._init_value,
            "decay_steps": self._decay_steps,
            "decay_rate": self._decay_rate,
            "staircase": self._staircase,
            "end_value": self._end_value,
            "total_steps": self.total_steps,
        }

    def _value(self, step: Any) -> Any:
        return functional.exponential_decay(
            step,
            init_value=self._init_value,
            decay_steps=self._decay_steps,
            decay_rate=self._decay_rate,
            staircase=self._staircase,
            end_value=self._end_value,
        )


class _DecayToEnd(Schedule):
    """A decay from `init_value` at step 0 to `end_value` at `total_steps`, then flat."""

    _decay_fn = staticmethod(functional.cosine_decay)
    _shape = "cosine"

    def __init__(
        self, init_value: float, *, end_value: float = 0.0, total_steps: int | None = None
    ):
        self._init_value = _checks.positive_number("init_value", init_value)
        self._end_value = _checks.non_negative_number("end_value", end_value)
        if self._end_value > self._init_value:
            raise ValueError(
                f"A {self._shape} decay ends at or below where it starts: `end_value` must be at "
                f"most `init_value`. Received: init_value={init_value!r}, end_value={end_value!r}"
            )
        super().__init__(total_steps=total_steps)

    def _arguments(self) -> dict[str, Any]:
        return {
            "init_value": self._init_value,
            "end_value": self._end_value,
            "total_steps": self.total_steps,
        }

    def _missing_training_length(self) -> str | None:
        if self.total_steps is None:
            return f"its {self._shape} decay ends at `total_steps`, which is not set"
        return None

    def _value(self, step: Any) -> Any:
        return self._decay_fn(
            step,
            init_value=self._init_value,
            end_value=self._end_value,
            decay_steps=self.total_steps,
        )


@keras.saving.register_keras_serializable(package="keras_accel")
class CosineDecay(_DecayToEnd):
    """Half a cosine from `init_value` at step 0 down to `end_value` at the end of training.

    `value(step) = end + (init - end) * (1 + cos(pi * min(step, total_steps) / total_steps)) / 2`.
    After `total_steps` the rate stays at `end_value`. Wrap it in `Warmup` for a warmup.

    Args:
        init_value: the learning rate at step 0, > 0.
        end_value: the learning rate at `total_steps`, in [0, init_value].
        total_steps: the length of the decay; may be given later through `with_total_steps()`.

    Example:

    >>> from keras_accel.schedules import CosineDecay
    >>> schedule = CosineDecay(1.0, total_steps=4)
    >>> [round(float(schedule(step)), 4) for step in range(6)]
    [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """

    _decay_fn = staticmethod(functional.cosine_decay)
    _shape = "cosine"


@keras.saving.register_keras_serializable(package="keras_accel")
class LinearDecay(_DecayToEnd):
    """A straight line from `init_value` at step 0 down to `end_value` at the end of training.

    `value(step) = init + (end - init) * min(step, total_steps) / total_steps`. After
    `total_steps` the rate stays at `end_value`. Wrap it in `Warmup` for a warmup.

    Args:
        init_value: the learning rate at step 0, > 0.
        end_value: the learning rate at `total_steps`, in [0, init_value].
        total_steps: the length of the decay; may be given later through `with_total_steps()`.

    Example:

    >>> from keras_accel.schedules import LinearDecay
    >>> schedule = LinearDecay(1.0, end_value=0.2, total_steps=4)
    >>> [round(float(schedule(step)), 4) for step in range(6)]
    [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    """

    _decay_fn = staticmethod(functional.linear_decay)
    _shape = "linear"
