"""`Schedule`: the base of every keras_accel schedule, and how it learns the training length."""

from __future__ import annotations

import copy
from typing import Any

import keras

from keras_accel.schedules import _checks, functional


def serialize_schedule(schedule: Any) -> Any:
    """A nested schedule as a JSON-friendly dict (the form `model.save` writes)."""
    return keras.saving.serialize_keras_object(schedule)


def deserialize_schedule(config: Any) -> Any:
    """Inverse of `serialize_schedule`; passes through objects that are already schedules."""
    if isinstance(config, dict):
        return keras.saving.deserialize_keras_object(config)
    return config


class Schedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule: a pure `step -> value` function plus the training length.

    Subclasses validate their arguments in `__init__`, describe them in `_arguments()`, derive
    everything that depends on the training length in `_resolve()`, and compute the value in
    `_value(step)` by calling a pure function from `keras_accel.schedules.functional`.

    **Training length.** Some schedules are written relative to the length of training (a
    boundary at `0.5` of training, a cosine that ends with training, boundaries in epochs).
    They take `total_steps` (and, for epochs, `steps_per_epoch`) at construction, or later from
    `with_total_steps()`, which returns a bound copy. Until then `needs_total_steps` is `True`
    and calling the schedule raises a `ValueError` that says what is missing. A training
    callback that knows the length binds the schedule once before training:

    ```python
    if schedule.needs_total_steps:
        schedule = schedule.with_total_steps(epochs * steps_per_epoch,
                                             steps_per_epoch=steps_per_epoch)
    ```

    `step` is the optimizer step: 0 for the first update, counted across epochs.

    Example:

    >>> from keras_accel.schedules import CosineDecay
    >>> schedule = CosineDecay(1.0)
    >>> schedule.needs_total_steps
    True
    >>> bound = schedule.with_total_steps(4)
    >>> bound.needs_total_steps, round(float(bound(2)), 4)
    (False, 0.5)
    """

    # Names of constructor arguments holding schedules, which `from_config` deserializes (a
    # subclass that takes schedules names them).
    schedule_arguments: tuple[str, ...] = ()

    def __init__(self, *, total_steps: int | None = None, steps_per_epoch: int | None = None):
        self._total_steps = _checks.optional_step_count("total_steps", total_steps)
        self._steps_per_epoch = _checks.optional_step_count("steps_per_epoch", steps_per_epoch)
        self._resolve()

    @property
    def total_steps(self) -> int | None:
        """The number of optimizer steps in training, or `None` if not known yet."""
        return self._total_steps

    @property
    def steps_per_epoch(self) -> int | None:
        """The number of optimizer steps per epoch, or `None` if not known."""
        return self._steps_per_epoch

    @property
    def needs_total_steps(self) -> bool:
        """Whether the schedule still lacks the training length it needs to be evaluated."""
        return self.missing_training_length is not None

    @property
    def missing_training_length(self) -> str | None:
        """Why the schedule cannot be evaluated yet (the training length it lacks, in
        words), or `None` once it can."""
        return self._missing_training_length()

    def with_total_steps(self, total_steps: int, *, steps_per_epoch: int | None = None) -> Schedule:
        """A copy of this schedule that knows the length of training.

        The schedule itself is left unchanged, so the same object can be bound to several runs.

        Args:
            total_steps: the number of optimizer steps in the whole of training, > 0.
            steps_per_epoch: the number of optimizer steps per epoch, > 0; needed only by
                boundaries given in epochs. `None` keeps the current value.

        Returns:
            A schedule of the same class with `total_steps` (and `steps_per_epoch`) set.

        Raises:
            ValueError: if a length is not a positive whole number, or the schedule does not
                fit in it (e.g. a warmup of `warmup_steps >= total_steps`).
        """
        total_steps = _checks.step_count("total_steps", total_steps, positive=True)
        if steps_per_epoch is None:
            steps_per_epoch = self.steps_per_epoch
        else:
            steps_per_epoch = _checks.step_count("steps_per_epoch", steps_per_epoch, positive=True)
        bound = copy.copy(self)
        # The copy learns the length as a schedule built with it does (and resolves it).
        Schedule.__init__(bound, total_steps=total_steps, steps_per_epoch=steps_per_epoch)
        return bound

    def __call__(self, step: Any) -> Any:
        missing = self._missing_training_length()
        if missing is not None:
            raise ValueError(
                f"{type(self).__name__} cannot be evaluated yet: {missing}. Pass "
                "`total_steps=` (or `steps_per_epoch=`) when building it, or bind it with "
                "`schedule.with_total_steps(total_steps, steps_per_epoch=...)` before training. "
                f"Received: total_steps={self._total_steps}, "
                f"steps_per_epoch={self._steps_per_epoch}"
            )
        return self._value(functional.as_step(step))

    def get_config(self) -> dict[str, Any]:
        config = {}
        for key, value in self._arguments().items():
            if isinstance(value, keras.optimizers.schedules.LearningRateSchedule):
                value = serialize_schedule(value)
            elif isinstance(value, list) and any(
                isinstance(v, keras.optimizers.schedules.LearningRateSchedule) for v in value
            ):
                value = [serialize_schedule(v) for v in value]
            config[key] = value
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Schedule:
        config = dict(config)
        for key in cls.schedule_arguments:
            value = config.get(key)
            if isinstance(value, list):
                config[key] = [deserialize_schedule(v) for v in value]
            else:
                config[key] = deserialize_schedule(value)
        return cls(**config)

    def __repr__(self) -> str:
        arguments = ", ".join(f"{key}={value!r}" for key, value in self._arguments().items())
        return f"{type(self).__name__}({arguments})"

    # Hooks for subclasses.

    def _arguments(self) -> dict[str, Any]:
        """The constructor arguments that rebuild this schedule (schedules as objects)."""
        raise NotImplementedError

    def _resolve(self) -> None:
        """Derive what depends on `total_steps` / `steps_per_epoch`; raise if it cannot fit."""

    def _missing_training_length(self) -> str | None:
        """Why the schedule cannot be evaluated yet, or `None` if it can."""
        return None

    def _value(self, step: Any) -> Any:
        """The learning rate at `step`, a float32 tensor; the training length is known."""
        raise NotImplementedError
