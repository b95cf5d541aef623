"""Linear warmup into any schedule, and the common warmup-then-cosine / -linear shapes."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_accel.schedules import _checks, functional
from keras_accel.schedules.base import Schedule
from keras_accel.schedules.decay import CosineDecay, LinearDecay


@keras.saving.register_keras_serializable(package="keras_accel")
class Warmup(Schedule):
    """Ramp the learning rate linearly up to where `schedule` starts, then follow `schedule`.

    For `step < warmup_steps` the rate goes in a straight line from `init_value` to
    `schedule(0)`; from `warmup_steps` on it is `schedule(step - warmup_steps)`, so `schedule`
    is written as if training started after the warmup. When this schedule knows
    `total_steps`, a keras_accel `schedule` without its own `total_steps` is bound to the
    steps after the warmup, `total_steps - warmup_steps`.

    Give the warmup length as `warmup_steps` (a number of steps) or `warmup_fraction` (a
    fraction of training, rounded to a step and always leaving one step after the warmup).

    Args:
        schedule: the schedule after the warmup, a `LearningRateSchedule`.
        warmup_steps: the length of the warmup in steps, >= 0 and < `total_steps`.
        warmup_fraction: the length of the warmup as a fraction of training, in (0, 1).
        init_value: the learning rate at step 0, >= 0.
        total_steps: optimizer steps in training; needed for `warmup_fraction` or when
            `schedule` needs it. May be given later through `with_total_steps()`.

    Example: warm up for 2 steps into an exponential decay.

    >>> from keras_accel.schedules import ExponentialDecay, Warmup
    >>> schedule = Warmup(ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5), warmup_steps=2)
    >>> [float(schedule(step)) for step in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.25]
    """

    schedule_arguments = ("schedule",)

    def __init__(
        self,
        schedule: keras.optimizers.schedules.LearningRateSchedule,
        *,
        warmup_steps: int | None = None,
        warmup_fraction: float | None = None,
        init_value: float = 0.0,
        total_steps: int | None = None,
    ):
        self._schedule = _checks.schedule("schedule", schedule)
        self._set_warmup(warmup_steps, warmup_fraction, init_value)
        super().__init__(total_steps=total_steps)

    def _set_warmup(
        self, warmup_steps: int | None, warmup_fraction: float | None, init_value: float
    ) -> None:
        if (warmup_steps is None) == (warmup_fraction is None):
            raise ValueError(
                "Give the warmup length exactly once: `warmup_steps` (a number of steps) or "
                "`warmup_fraction` (a fraction of training, e.g. 0.05). "
                f"Received: warmup_steps={warmup_steps!r}, warmup_fraction={warmup_fraction!r}"
            )
        self._warmup_steps = None
        self._warmup_fraction = None
        if warmup_steps is not None:
            self._warmup_steps = _checks.step_count("warmup_steps", warmup_steps)
        else:
            self._warmup_fraction = _checks.fraction("warmup_fraction", warmup_fraction)
        self._init_value = _checks.non_negative_number("init_value", init_value)

    def _arguments(self) -> dict[str, Any]:
        return {
            "schedule": self._schedule,
            "warmup_steps": self._warmup_steps,
            "warmup_fraction": self._warmup_fraction,
            "init_value": self._init_value,
            "total_steps": self.total_steps,
        }

    def _resolve(self) -> None:
        total = self.total_steps
        if self._warmup_steps is not None:
            warmup = self._warmup_steps
            if total is not None and warmup >= total:
                raise ValueError(
                    "The warmup must be shorter than training: `warmup_steps` must be smaller "
                    f"than `total_steps`. Received: warmup_steps={warmup}, total_steps={total}"
                )
        elif total is not None:
            # However short the run, keep one step after the warmup for the schedule proper.
            warmup = min(_checks.round_steps(self._warmup_fraction * total), total - 1)
        else:
            warmup = None
        self._resolved_warmup = warmup

        after = self._schedule
        if (
            isinstance(after, Schedule)
            and after.total_steps is None
            and warmup is not None
            and total is not None
        ):
            after = after.with_total_steps(total - warmup, steps_per_epoch=self.steps_per_epoch)
        self._after = after

    def _missing_training_length(self) -> str | None:
        if self._resolved_warmup is None:
            return (
                f"its warmup is a fraction of training (warmup_fraction={self._warmup_fraction})"
                " and `total_steps` is not set"
            )
        if isinstance(self._after, Schedule) and self._after.needs_total_steps:
            reason = self._after.missing_training_length
            return f"the {type(self._after).__name__} after the warmup needs it: {reason}"
        return None

    def _value(self, step: Any) -> Any:
        warmup_steps = self._resolved_warmup
        if warmup_steps == 0:
            # A Keras schedule inside may return another dtype; ours always give float32.
            return ops.cast(self._after(step), "float32")
        peak = functional.as_step(self._after(ops.zeros_like(step)))

        def ramp(local_step: Any) -> Any:
            return functional.linear_warmup(
                local_step, init_value=self._init_value, peak_value=peak, warmup_steps=warmup_steps
            )

        return functional.join(step, schedules=[ramp, self._after], boundaries=[warmup_steps])


class _WarmupDecay(Warmup):
    """Linear warmup to `peak_value`, then a decay to `end_value` at the end of training."""

    _decay_class: type[Schedule] = CosineDecay
    schedule_arguments = ()

    def __init__(
        self,
        peak_value: float,
        *,
        warmup_steps: int | None = None,
        warmup_fraction: float | None = None,
        init_value: float = 0.0,
        end_value: float = 0.0,
        total_steps: int | None = None,
    ):
        peak_value = _checks.positive_number("peak_value", peak_value)
        end_value = _checks.non_negative_number("end_value", end_value)
        init_value = _checks.non_negative_number("init_value", init_value)
        if end_value > peak_value or init_value > peak_value:
            raise ValueError(
                "`peak_value` is the highest learning rate: `init_value` and `end_value` must "
                f"not exceed it. Received: init_value={init_value!r}, peak_value={peak_value!r}, "
                f"end_value={end_value!r}"
            )
        self._peak_value = peak_value
        self._end_value = end_value
        self._schedule = self._decay_class(peak_value, end_value=end_value)
        self._set_warmup(warmup_steps, warmup_fraction, init_value)
        # Skip `Warmup.__init__`, which takes a ready-made schedule; the decay is built above.
        Schedule.__init__(self, total_steps=total_steps)

    def _arguments(self) -> dict[str, Any]:
        return {
            "peak_value": self._peak_value,
            "warmup_steps": self._warmup_steps,
            "warmup_fraction": self._warmup_fraction,
            "init_value": self._init_value,
            "end_value": self._end_value,
            "total_steps": self.total_steps,
        }

    def _missing_training_length(self) -> str | None:
        if self.total_steps is None:
            return "its decay ends at `total_steps`, which is not set"
        return None


@keras.saving.register_keras_serializable(package="keras_accel")
class WarmupCosine(_WarmupDecay):
    """Linear warmup from `init_value` to `peak_value`, then cosine decay to `end_value`.

    The warmup takes `warmup_steps` steps (or `warmup_fraction` of training); the cosine
    decay takes the rest, reaching `end_value` at `total_steps`, after which the rate stays
    there. The same as `Warmup(CosineDecay(peak_value, end_value=end_value), ...)`.

    Args:
        peak_value: the learning rate at the end of the warmup, > 0.
        warmup_steps: the length of the warmup in steps, >= 0 and < `total_steps`.
        warmup_fraction: the length of the warmup as a fraction of training, in (0, 1).
        init_value: the learning rate at step 0, in [0, peak_value].
        end_value: the learning rate at `total_steps`, in [0, peak_value].
        total_steps: optimizer steps in training; may be given later through
            `with_total_steps()`.

    Example:

    >>> import keras
    >>> from keras_accel.schedules import WarmupCosine
    >>> schedule = WarmupCosine(1e-3, warmup_steps=100, total_steps=1000)
    >>> optimizer = keras.optimizers.Adam(learning_rate=schedule)
    >>> [round(float(schedule(step)), 6) for step in (0, 50, 100, 550, 1000)]
    [0.0, 0.0005, 0.001, 0.0005, 0.0]
    """

    _decay_class = CosineDecay


@keras.saving.register_keras_serializable(package="keras_accel")
class WarmupLinear(_WarmupDecay):
    """Linear warmup from `init_value` to `peak_value`, then linear decay to `end_value`.

    The warmup takes `warmup_steps` steps (or `warmup_fraction` of training); the linear
    decay takes the rest, reaching `end_value` at `total_steps`, after which the rate stays
    there. The same as `Warmup(LinearDecay(peak_value, end_value=end_value), ...)`.

    Args:
        peak_value: the learning rate at the end of the warmup, > 0.
        warmup_steps: the length of the warmup in steps, >= 0 and < `total_steps`.
        warmup_fraction: the length of the warmup as a fraction of training, in (0, 1).
        init_value: the learning rate at step 0, in [0, peak_value].
        end_value: the learning rate at `total_steps`, in [0, peak_value].
        total_steps: optimizer steps in training; may be given later through
            `with_total_steps()`.

    Example: warm up over the first 10% of training.

    >>> from keras_accel.schedules import WarmupLinear
    >>> schedule = WarmupLinear(1.0, warmup_fraction=0.1, total_steps=20)
    >>> [round(float(schedule(step)), 4) for step in (0, 1, 2, 11, 20)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """

    _decay_class = LinearDecay
