"""`Join`: run several schedules one after another, like `optax.join_schedules`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_accel.schedules import _checks, functional
from keras_accel.schedules.base import Schedule


@keras.saving.register_keras_serializable(package="keras_accel")
class Join(Schedule):
    """Follow `schedules[0]` until the first boundary, then `schedules[1]`, and so on.

    Each schedule after the first restarts from its own step 0 at its boundary: from
    `boundaries[i - 1]` on the rate is `schedules[i](step - boundaries[i - 1])`. Boundaries
    are counted in `unit` as in `PiecewiseConstant` (`"steps"`, `"epochs"` or `"fraction"`).

    Each keras_accel schedule in `schedules` without its own `total_steps` is bound to the
    length of its piece, so its fractions and decays are relative to that piece: the pieces
    between boundaries as soon as the boundaries are in steps, the last piece once this
    schedule knows `total_steps`.

    Args:
        schedules: the `LearningRateSchedule`s, one more than `boundaries`.
        boundaries: strictly increasing, each > 0 (and < 1 for fractions).
        unit: `"steps"`, `"epochs"` or `"fraction"`.
        steps_per_epoch: optimizer steps per epoch; needed for `unit="epochs"`.
        total_steps: optimizer steps in training; needed for `unit="fraction"` or when the
            last schedule needs its length. May be given later through `with_total_steps()`.

    Example: hold the rate for 3 steps, then decay it linearly to 0 by step 7.

    >>> from keras_accel.schedules import Constant, Join, LinearDecay
    >>> schedule = Join([Constant(1.0), LinearDecay(1.0)], boundaries=[3], total_steps=7)
    >>> [float(schedule(step)) for step in range(8)]
    [1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """

    schedule_arguments = ("schedules",)

    def __init__(
        self,
        schedules: Sequence[keras.optimizers.schedules.LearningRateSchedule],
        boundaries: Sequence[float],
        unit: str = "steps",
        *,
        steps_per_epoch: int | None = None,
        total_steps: int | None = None,
    ):
        if isinstance(schedules, (str, bytes)) or not isinstance(schedules, Sequence):
            raise ValueError(
                f"`schedules` must be a list of schedules. Received: schedules={schedules!r}"
            )
        self._schedules = [
            _checks.schedule(f"schedules[{i}]", schedule) for i, schedule in enumerate(schedules)
        ]
        self._unit = _checks.unit(unit)
        self._boundaries = _checks.boundaries(boundaries, self._unit)
        if len(self._schedules) != len(self._boundaries) + 1:
            raise ValueError(
                "`schedules` must have exactly one more entry than `boundaries`: the schedule "
                "before the first boundary, then one after each boundary. "
                f"Received: {len(self._schedules)} schedules, boundaries={list(boundaries)!r} "
                f"({len(self._boundaries)} entries)"
            )
        super().__init__(total_steps=total_steps, steps_per_epoch=steps_per_epoch)

    def _arguments(self) -> dict[str, Any]:
        return {
            "schedules": list(self._schedules),
            "boundaries": list(self._boundaries),
            "unit": self._unit,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
        }

    def _resolve(self) -> None:
        total = self.total_steps
        starts = _checks.resolve_boundaries(
            self._boundaries, self._unit, steps_per_epoch=self.steps_per_epoch, total_steps=total
        )
        self._step_boundaries = starts
        self._pieces: list[tuple[int, Any]] = []
        if starts is None:
            return
        starts = [0, *starts]
        last = len(self._schedules) - 1
        for index, (start, schedule) in enumerate(zip(starts, self._schedules)):
            end = starts[index + 1] if index < last else total
            if index < last and end == start:
                # Two boundaries rounded onto the same step (a very short run): the piece
                # between them never runs, so it is dropped rather than bound to 0 steps.
                continue
            if isinstance(schedule, Schedule) and schedule.total_steps is None and end is not None:
                if end <= start:
                    if schedule.needs_total_steps:
                        raise ValueError(
                            f"The last boundary leaves no steps for schedules[{index}] "
                            f"({type(schedule).__name__}), which needs its length: the last "
                            "boundary must be before `total_steps`. "
                            f"Received: boundaries={self._boundaries!r} (step {start}), "
                            f"total_steps={total}"
                        )
                else:
                    schedule = schedule.with_total_steps(
                        end - start, steps_per_epoch=self.steps_per_epoch
                    )
            self._pieces.append((start, schedule))

    def _missing_training_length(self) -> str | None:
        if self._step_boundaries is None:
            if self._unit == "epochs":
                return "its boundaries are in epochs and `steps_per_epoch` is not set"
            return "its boundaries are fractions of training and `total_steps` is not set"
        for start, schedule in self._pieces:
            if isinstance(schedule, Schedule) and schedule.needs_total_steps:
                reason = schedule.missing_training_length
                return f"the {type(schedule).__name__} from step {start} needs it: {reason}"
        return None

    def _value(self, step: Any) -> Any:
        return functional.join(
            step,
            schedules=[schedule for _, schedule in self._pieces],
            boundaries=[start for start, _ in self._pieces[1:]],
        )
