"""`LearningRateScheduler`: Keras's callback, plus per-step schedules, on every strategy."""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from keras_accel.adapter.protocol import run_context
from keras_accel.callbacks._run import run_state
from keras_accel.schedules import validate_learning_rate
from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer
from keras_accel.utils.printing import print_msg

UPDATE_FREQS = ("epoch", "step")


class LearningRateScheduler(keras.callbacks.Callback):
    """Sets the optimizer's learning rate from a schedule, every epoch or every step.

    A drop-in for `keras.callbacks.LearningRateScheduler(schedule, verbose=0)`: with the
    default `update_freq="epoch"`, `schedule(epoch, lr)` (or `schedule(epoch)`) is called at
    the start of each epoch with the epoch index and the current rate, as in Keras. It adds:

    - `update_freq="step"`: `schedule(step)` (or `schedule(step, lr)`) before every optimizer
      step, where `step` is the optimizer's iteration count (0 for the first update, counted
      across epochs, and restored by `BackupAndRestore`, so a resumed run continues the
      schedule where it stopped). `schedule` may be any function of the step, a
      `keras.optimizers.schedules.LearningRateSchedule`, or a `keras_accel.schedules`
      schedule; one that needs the training length is bound to `epochs * steps` of the fit.
    - It works when the optimizer was built with a schedule object (Keras's raises a
      TypeError there): the optimizer's rate becomes a variable that this callback sets,
      and it stays one after training.
    - The schedule is called once, with the arguments its signature asks for; a TypeError
      inside it is never retried with other arguments. A result that is not one finite
      number >= 0 raises a ValueError naming the epoch or step and the value.
    - The applied rate goes into the logs as `learning_rate` (per epoch; and per batch in
      step mode), so `History` and the progress bar show it.

    Under distribution the rate is a replicated optimizer variable: one assignment from the
    callback reaches every replica (a `tf.distribute` MirroredVariable, or a replicated JAX
    array that the compiled step receives as part of its state).

    Args:
        schedule: a callable `(index) -> rate` or `(index, current_rate) -> rate`, where
            `index` is the epoch (`update_freq="epoch"`) or the optimizer step ("step").
        verbose: 0 is silent; 1 prints Keras's message ("Epoch 3: LearningRateScheduler
            setting learning rate to 0.01.") at every epoch, or in step mode whenever the
            rate changes; to stdout, or to absl logging when
            `keras.config.disable_interactive_logging()` was called, as Keras does.
        update_freq: "epoch" (default, as in Keras) or "step".

    Example: divide the learning rate by 10 at 50% of training, applied every step.

    >>> import keras, numpy as np
    >>> from keras_accel.callbacks import LearningRateScheduler
    >>> from keras_accel.schedules import PiecewiseConstant
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.1), "mse")
    >>> halve = PiecewiseConstant([0.1, 0.01], boundaries=[0.5], unit="fraction")
    >>> history = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, epochs=2,
    ...                     verbose=0, callbacks=[LearningRateScheduler(halve, update_freq="step")])
    >>> [round(rate, 4) for rate in history.history["learning_rate"]]
    [0.1, 0.01]
    """

    def __init__(
        self,
        schedule: Callable[..., Any],
        verbose: int = 0,
        update_freq: str = "epoch",
    ):
        # The Keras internals our callbacks rely on, checked once, under a plain model.fit too.
        keras_internals.check()
        super().__init__()
        if not callable(schedule):
            raise TypeError(
                "`schedule` must be callable: a function of the epoch or step (optionally "
                "also of the current rate), or a learning-rate schedule object. "
                f"Received: schedule={schedule!r} of type {type(schedule).__name__}"
            )
        if update_freq not in UPDATE_FREQS:
            raise ValueError(
                f"`update_freq` must be one of {UPDATE_FREQS}. "
                f"Received: update_freq={update_freq!r}"
            )
        self.schedule = schedule
        self.verbose = verbose
        self.update_freq = update_freq
        self._passes_rate = _passes_rate(schedule)
        self._bound = None
        self._step = None  # Host-side step count, so that no step waits on the device.
        self._last_batch = None
        self._restores_seen = None
        self._applied = None
        # Under host-loop fusion (set for one Accelerator call): the bound schedule, which
        # the optimizer then evaluates inside every step.
        self._in_step = None
        self._group = None
        # Puts back what this fit changed on the optimizer (its schedule, where it was built
        # with one) and the model's train function, at `on_train_end`.
        self._give_back = None

    # ------------------------------------------------------------------ fusion
    def fusion_period(self, kind: str, steps: int | None) -> int | None:
        """What host-loop fusion this callback takes (`keras_accel.adapter.protocol`): any,
        except a per-step schedule that is a plain function, which runs on the host."""
        if kind != "train" or self.update_freq != "step" or self._schedule_in_step():
            return None
        return 1

    def _schedule_in_step(self) -> bool:
        # A LearningRateSchedule is a function of the step count in backend ops: it can
        # run inside the compiled step. Any other callable may hold host-only Python.
        return isinstance(self.schedule, keras.optimizers.schedules.LearningRateSchedule)

    def set_run_context(self, context) -> None:
        """For one Accelerator fit (`keras_accel.adapter.protocol`), undone through
        `context.call_on_exit` on every way out of the call.

        Fused (steps_per_execution > 1) with a per-step schedule object: the optimizer
        evaluates the schedule itself, at its own step count, inside every compiled step, so
        the rate changes at every step of a group; the hooks only report it. Otherwise the
        rate variable the hooks set is installed here, before the Accelerator keys its
        compiled steps, so a later fit finds them again (the same variable is installed
        again)."""
        model = context.model
        if context.kind != "train" or getattr(model, "optimizer", None) is None:
            return
        n = context.steps_per_execution
        if n > 1 and self.update_freq == "step" and self._schedule_in_step():
            bound = self._bind({"epochs": context.epochs, "steps": context.steps})
            # A float-built optimizer's rate variable ends at the last rate (`on_train_end`),
            # as a step-by-step run leaves it; a schedule-built one gets its schedule back.
            optimizer = inner_optimizer(model.optimizer)
            current = keras_internals.learning_rate_of(optimizer)
            self._variable = current if isinstance(current, keras.Variable) else None
            _set_for_call(context, optimizer, keras_internals.LEARNING_RATE, bound)
            _set_for_call(context, self, "_in_step", bound)
            return
        _, give_back = rate_variable(model)
        if give_back is not None:
            context.call_on_exit(give_back)

    # ------------------------------------------------------------------ hooks
    def set_model(self, model):
        # The Keras internals read on the model and its optimizer: checked before any step.
        keras_internals.check_model(model)
        super().set_model(model)
        # fit calls this before it builds its train function, which then includes the
        # rate variable; a function built earlier around a schedule is dropped.
        if getattr(model, "optimizer", None) is not None and self._in_step is None:
            _, give_back = rate_variable(model)
            if give_back is not None:
                self._took(model, give_back)

    def on_train_begin(self, logs=None):
        model = self.model
        if model.optimizer is None:
            raise ValueError(
                "LearningRateScheduler needs a compiled model with an optimizer. "
                "Call model.compile(optimizer=...) before fit."
            )
        self._step = None
        if self._in_step is not None:
            self._bound = self._in_step
            return
        _, give_back = rate_variable(model)
        if give_back is not None:  # Driven without set_model: rebuild the step around it.
            self._took(model, give_back)
            model.make_train_function(force=True)
        self._bound = self._bind()
        if self.update_freq == "step" and (getattr(model, "steps_per_execution", 1) or 1) > 1:
            warnings.warn(
                f"LearningRateScheduler(update_freq='step') runs between executions: with "
                f"steps_per_execution={model.steps_per_execution} the rate changes once per "
                f"{model.steps_per_execution} steps. Pass the schedule as the optimizer's "
                "learning_rate instead to change it inside every step.",
                stacklevel=2,
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._step = None  # Re-read the optimizer's count once per epoch.
        if self.update_freq != "epoch":
            return
        self._set(self.model, epoch, "epoch")

    def on_train_batch_begin(self, batch, logs=None):
        if self.update_freq != "step":
            return
        # `self.model` also pulls the JAX training state back onto the variables, so that
        # the assignment below reaches the next compiled step.
        if self._in_step is not None:
            # The optimizer applies the rates itself: only count, syncing JAX state (via
            # `self.model`) once per epoch, when the optimizer's count is read.
            model = self.model if self._step is None else self._model
            self._group = (batch, self._current_step(model, batch))
            return
        model = self.model
        self._set(model, self._current_step(model, batch), "step")

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq != "step":
            return
        if self._in_step is not None and self._group is not None:
            # A fused group ran steps first..last: report the rate of its last step.
            first_batch, first_step = self._group
            steps = (self.params or {}).get("steps")
            last = min(batch, steps - 1) if steps else batch
            self._report(first_step + last - first_batch, "step", self._in_step)
        if logs is not None and self._applied is not None:
            logs["learning_rate"] = self._applied

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._applied is not None:
            logs["learning_rate"] = self._applied

    def on_train_end(self, logs=None):
        if self._in_step is not None and self._applied is not None and self._variable is not None:
            self.model  # noqa: B018 -- pulls the JAX training state onto the variables first.
            self._variable.assign(self._applied)
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back()

    def _took(self, model, give_back) -> None:
        """This fit installed a rate variable (`give_back` removes it): the train function
        traced before reads the optimizer's schedule, so it is set aside for this fit and
        comes back with the schedule. Keras skips `on_train_end` when fit raises: then the
        variable stays, holding the last rate (under an Accelerator call, the call puts the
        schedule back on every way out)."""
        previous = model.train_function
        model.train_function = None

        def undo():
            give_back()
            model.train_function = previous

        if self._give_back is None:
            self._give_back = undo

    # ------------------------------------------------------------------ helpers
    def _bind(self, params=None):
        """The schedule, bound to the length of this fit if it needs one."""
        schedule = self.schedule
        if not getattr(schedule, "needs_total_steps", False):
            return schedule
        params = self.params if params is None else params
        epochs = (params or {}).get("epochs")
        steps = (params or {}).get("steps")
        if self.update_freq == "epoch":
            if not epochs:
                raise ValueError(
                    f"{schedule!r} needs the number of epochs, which this fit does not give. "
                    "Bind it with schedule.with_total_steps(epochs) first."
                )
            return schedule.with_total_steps(int(epochs), steps_per_epoch=1)
        if not epochs or not steps:
            raise ValueError(
                f"{schedule!r} needs the length of training, but this fit does not say how "
                f"many steps an epoch has (epochs={epochs}, steps={steps}). Pass "
                "steps_per_epoch to fit, or bind the schedule with "
                "schedule.with_total_steps(total_steps, steps_per_epoch=...) first."
            )
        return schedule.with_total_steps(int(epochs) * int(steps), steps_per_epoch=int(steps))

    def _current_step(self, model, batch: int) -> int:
        optimizer = model.optimizer
        context = run_context(model)
        recount = (
            self._step is None
            or context.restores != self._restores_seen
            or getattr(optimizer, "gradient_accumulation_steps", None)
        )
        if recount:
            self._step = host_step(optimizer.iterations)
            self._restores_seen = context.restores
        else:
            self._step += batch - self._last_batch
        self._last_batch = batch
        return self._step

    def _set(self, model, index: int, unit: str) -> None:
        variable, _ = rate_variable(model)
        schedule = self._bound if self._bound is not None else self.schedule
        if self._passes_rate:
            current = float(_host(variable))
            value = schedule(index, current)
        else:
            value = schedule(index)
        rate = _check(value, index, unit, schedule)
        variable.assign(rate)
        self._announce(rate, value, index, unit)

    def _report(self, index: int, unit: str, schedule) -> None:
        """The rate `schedule` gives at `index`, checked and reported, not assigned."""
        value = schedule(index)
        self._announce(_check(value, index, unit, schedule), value, index, unit)

    def _announce(self, rate: float, value, index: int, unit: str) -> None:
        model = self._model
        # Keras's message, every epoch; in step mode only when the rate changes (one line
        # per step would drown the progress bar). Keras numbers epochs from 1, steps from 0.
        if self.verbose > 0 and (unit == "epoch" or rate != self._applied):
            shown = value if isinstance(value, (float, np.floating)) else rate
            label = f"Epoch {index + 1}" if unit == "epoch" else f"Step {index}"
            print_msg(f"\n{label}: LearningRateScheduler setting learning rate to {shown}.")
        self._applied = rate
        run_state(model).learning_rate = rate


def _set_for_call(context, obj, name: str, value) -> None:
    """`obj.name = value` until the Accelerator call ends; through the instance's
    `__dict__`, which Keras's attribute tracking does not see (as the call's own changes)."""
    namespace = vars(obj)
    old = namespace[name]
    object.__setattr__(obj, name, value)
    context.call_on_exit(lambda: namespace.__setitem__(name, old))


def _host(value) -> np.ndarray:
    """A variable or tensor on the host (a tf.distribute variable's `.value` cannot be
    converted inside its strategy's scope, `.numpy()` can)."""
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


def optimizer_rate(optimizer, step: int | None = None) -> float:
    """The learning rate `optimizer` applies at `step` (by default its next step, read
    from its iteration count): its variable's value, its schedule at that step, what a
    callable rate returns, or its float. A LossScaleOptimizer's is the one it wraps."""
    optimizer = inner_optimizer(optimizer)
    rate = keras_internals.learning_rate_of(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(host_step(optimizer.iterations) if step is None else step)
    elif callable(rate) and not isinstance(rate, keras.Variable):
        rate = rate()
    return float(_host(rate).reshape(-1)[0])


def host_step(iterations) -> int:
    """The optimizer's iteration count as one Python int, read once on the host.

    The count is replicated: under a tf.distribute strategy it is a MirroredVariable, and
    what a read returns can hold one copy per replica. Every copy holds the same count, so
    one is read; the schedule then gets a plain int, never a distributed variable (computing
    a schedule on the variable itself and converting the result fails on MirroredStrategy).
    """
    array = _host(iterations).reshape(-1)
    if array.size == 0 or not np.all(array == array[0]):
        raise ValueError(
            "The optimizer's iteration count must be one integer, the same on every replica. "
            f"Received: iterations={array.tolist()}"
        )
    return int(array[0])


def _passes_rate(schedule: Callable[..., Any]) -> bool:
    """Whether `schedule` takes (index, rate) rather than (index): read from its signature,
    never found out by calling it and catching a TypeError."""
    try:
        signature = inspect.signature(schedule)
    except (TypeError, ValueError):
        return True  # A builtin without a signature: Keras's first guess is (epoch, lr).
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    variadic = any(p.kind == p.VAR_POSITIONAL for p in signature.parameters.values())
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 2 or (not positional and not variadic):
        raise TypeError(
            "`schedule` must take the epoch (or step) and optionally the current rate: "
            f"`schedule(index)` or `schedule(index, lr)`. Received: {schedule!r} with "
            f"signature {signature}"
        )
    return variadic or len(positional) >= 2


def _check(value: Any, index: int, unit: str, schedule: Any) -> float:
    try:
        return validate_learning_rate(value, index)
    except ValueError:
        pass
    name = getattr(schedule, "__name__", None) or repr(schedule)
    raise ValueError(
        # Keras's wording first, then which call and what would work.
        f"The output of the `schedule` function should be a float. Got: {value}. "
        f"LearningRateScheduler: the schedule {name} returned an invalid learning rate for "
        f"{unit} {index}: a rate must be one finite number >= 0 (a Python or NumPy float, "
        f"or a one-element tensor). Received: value={value!r} (type "
        f"{type(value).__name__}), {unit}={index}"
    )


# The rate variable made for each optimizer built with a schedule: installed again by the
# next fit, so that the steps compiled around it (which the Accelerator keeps between
# calls, and a custom loop's) still read the variable the optimizer holds.
_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rate_variable(model) -> tuple[Any, Callable[[], None] | None]:
    """`(variable, give_back)`: the optimizer's learning-rate variable, and None where it
    had one; where the optimizer has a schedule, a variable installed in its place, and
    `give_back()`, which puts the schedule back and the optimizer's variable list as it was.

    Keras keeps a float rate in a variable that is part of the optimizer's state (so the
    compiled step reads it on every backend), but keeps a schedule object as a function of
    the iteration count, which cannot be set. The schedule is replaced, for one fit, by a
    variable holding its current value. A train function traced before must be rebuilt
    (the caller does): `tf.function` would keep reading the schedule it captured.
    """
    optimizer = inner_optimizer(model.optimizer)
    current = keras_internals.learning_rate_of(optimizer)
    if isinstance(current, keras.Variable):
        return current, None
    initial = optimizer_rate(optimizer)
    iterations = keras_internals.iteration_variable(optimizer)
    where = (_strategy(model), keras_internals.variable_layout(iterations))
    made = _MADE.get(optimizer)
    if made is not None and all(a is b for a, b in zip(made[1], where)):
        variable = made[0]
        variable.assign(initial)
    else:
        with _variable_scope(model), keras.name_scope(optimizer.name, caller=optimizer):
            variable = keras.Variable(
                initial,
                name="learning_rate",
                dtype=keras.config.floatx(),
                trainable=False,
                aggregation="only_first_replica",
            )
        _place_like(variable, iterations)
        _MADE[optimizer] = (variable, where)
    # Keras's attribute tracking adds it to `variables`.
    keras_internals.set_learning_rate_of(optimizer, variable)
    # Exactly once, right after the iteration count: where an optimizer built with a float
    # rate has it, so weights saved now load into an optimizer rebuilt from its config.
    variables = keras_internals.optimizer_variables(optimizer)
    others = [v for v in variables if v is not variable]
    position = next((i + 1 for i, v in enumerate(others) if v is iterations), 0)
    others.insert(position, variable)
    variables[:] = others

    def give_back() -> None:
        if keras_internals.learning_rate_of(optimizer) is variable:
            # Keras's own setter: a schedule replaces the variable, which it untracks.
            optimizer.learning_rate = current
        variables = keras_internals.optimizer_variables(optimizer)
        variables[:] = [v for v in variables if v is not variable]

    return variable, give_back


def _strategy(model):
    """The tf.distribute strategy the model's variables live in (None on other backends)."""
    if keras.backend.backend() != "tensorflow":
        return None
    return keras_internals.distribute_strategy_of(model)


def _variable_scope(model):
    """Where the model's variables live: its tf.distribute strategy on TensorFlow."""
    strategy = _strategy(model)
    if strategy is not None:
        return strategy.scope()
    return contextlib.nullcontext()


def _place_like(variable, reference) -> None:
    """On JAX, lay the new variable out like the optimizer's others (replicated over the
    mesh) when it was created outside the distribution's scope."""
    if keras.backend.backend() != "jax":
        return
    layout = keras_internals.variable_layout(reference)
    if layout is not None and keras_internals.variable_layout(variable) is None:
        keras_internals.set_variable_layout(variable, layout)
        variable.assign(variable.value)
