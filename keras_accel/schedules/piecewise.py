"""Flat schedules: one constant rate, or constant rates between boundaries (step decay)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_accel.schedules import _checks, functional
from keras_accel.schedules.base import Schedule


@keras.saving.register_keras_serializable(package="keras_accel")
class Constant(Schedule):
    """The same learning rate at every step.

    Useful as a piece of a `Join`, or to give a float rate the schedule interface.

    Args:
        value: the learning rate, > 0.
        total_steps: the number of training steps; not needed, kept for a uniform interface.

    Example:

    >>> from keras_accel.schedules import Constant
    >>> round(float(Constant(1e-3)(10)), 6)
    0.001
    """

    def __init__(self, value: float, *, total_steps: int | None = None):
        self._constant = _checks.positive_number("value", value)
        super().__init__(total_steps=total_steps)

    def _arguments(self) -> dict[str, Any]:
        return {"value": self._constant, "total_steps": self.total_steps}

    def _value(self, step: Any) -> Any:
        return functional.constant(step, value=self._constant)


@keras.saving.register_keras_serializable(package="keras_accel")
class PiecewiseConstant(Schedule):
    """Constant learning rates that change at boundaries: step decay.

    `values[0]` holds until the first boundary; `values[i]` holds from `boundaries[i - 1]` on.
    The rate changes *at* the boundary step. Boundaries are counted in `unit`:

    - `"steps"`: optimizer steps (whole numbers).
    - `"epochs"`: epochs, converted with `steps_per_epoch` (fractional epochs allowed).
    - `"fraction"`: fractions of training in (0, 1), converted with `total_steps`.

    A converted boundary is rounded to the nearest step (halves round up).

    Args:
        values: the learning rates, each > 0; one more than `boundaries`.
        boundaries: strictly increasing, each > 0 (and < 1 for fractions).
        unit: `"steps"`, `"epochs"` or `"fraction"`.
        steps_per_epoch: optimizer steps per epoch; needed for `unit="epochs"`.
        total_steps: optimizer steps in training; needed for `unit="fraction"`. Both may
            instead be given later through `with_total_steps()`.

    Example: divide the learning rate by 10 half-way through training.

    >>> from keras_accel.schedules import PiecewiseConstant
    >>> schedule = PiecewiseConstant(
    ...     values=[1e-3, 1e-4], boundaries=[0.5], unit="fraction", total_steps=100)
    >>> [round(float(schedule(step)), 6) for step in (0, 49, 50, 99)]
    [0.001, 0.001, 0.0001, 0.0001]
    """

    def __init__(
        self,
        values: Sequence[float],
        boundaries: Sequence[float],
        unit: str = "steps",
        *,
        steps_per_epoch: int | None = None,
        total_steps: int | None = None,
    ):
        self._unit = _checks.unit(unit)
        self._values = _checks.learning_rates("values", values)
        self._boundaries = _checks.boundaries(boundaries, self._unit)
        if len(self._values) != len(self._boundaries) + 1:
            raise ValueError(
                "`values` must have exactly one more entry than `boundaries`: the rate before "
                "the first boundary, then one after each boundary. "
                f"Received: values={list(values)!r} ({len(self._values)} entries), "
                f"boundaries={list(boundaries)!r} ({len(self._boundaries)} entries)"
            )
        super().__init__(total_steps=total_steps, steps_per_epoch=steps_per_epoch)

    def _arguments(self) -> dict[str, Any]:
        return {
            "values": list(self._values),
            "boundaries": list(self._boundaries),
            "unit": self._unit,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
        }

    def _resolve(self) -> None:
        self._step_boundaries = _checks.resolve_boundaries(
            self._boundaries,
            self._unit,
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
        )

    def _missing_training_length(self) -> str | None:
        if self._step_boundaries is not None:
            return None
        if self._unit == "epochs":
            return "its boundaries are in epochs and `steps_per_epoch` is not set"
        return "its boundaries are fractions of training and `total_steps` is not set"

    def _value(self, step: Any) -> Any:
        return functional.piecewise_constant(
            step, values=self._values, boundaries=self._step_boundaries
        )
