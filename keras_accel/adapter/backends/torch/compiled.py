"""torch: Keras's train and test steps as one compiled program each (`torch.compile`).

Keras's torch trainer runs a step eagerly: every layer's `__call__`, the loss, the metrics
and the optimizer's update run as Python, a few milliseconds per step whatever the model's
size, several times what the step's arithmetic costs on a small model. Keras's own
`jit_compile=True` compiles the step up to `loss.backward()`, which torch's compiler does not
trace, so the backward pass and the update still run as Python.

Here the step is written the way Keras's JAX trainer writes it, statelessly: the variables'
values go in, the loss's gradient comes from `torch.func.grad_and_value`, the optimizer's
update from `optimizer.stateless_apply`, the metrics' from a `StatelessScope`, and the new
values come out. That whole step traces as one graph (`fullgraph=True`): forward, loss,
backward, update and metrics are one program, compiled once per input signature, and a step
costs one call. The numbers are Keras's torch step's (the same layers, loss, optimizer and
metrics code runs, traced): the suite's exactness tests run through it.

What it takes over (the rest stays Keras's eager step, unchanged):
- the train and test steps Keras's trainer defines (a model that overrides `train_step` or
  `test_step` runs its own, eagerly); over several processes with their collectives traced
  into the program (the gradients' average in the optimizer's `apply`, the metrics'
  reduction where a process reads a step's logs), every process compiling the same step
  alike, and falling back alike where torch cannot compile it (then the eager step's
  all-reduce overlaps its backward pass: `GradientBuckets`);
- from each call's second step of a kind: the first runs eagerly, which builds what Keras
  builds lazily (the optimizer's slots, the compiled metrics) and says which weights get
  no gradient (they get none here either).

When it compiles: with `model.compile(jit_compile=True)` (or `Accelerator(jit_compile=True)`,
`KERAS_ACCEL_JIT_COMPILE=1`), from each call's second step; otherwise ("auto", Keras's torch
default) where it was measured faster on the model's own steps (`keras_accel.adapter.
choice`): once the model's eager steps of a kind have taken about a compilation's time
(seconds on a CPU), a trial times compiled steps beside eager ones and keeps the faster,
remembered for the model's architecture, input signature and machine. Never with
`run_eagerly=True`, `Accelerator(jit_compile=False)` or `KERAS_ACCEL_JIT_COMPILE=0`. Over
several processes the measurements are agreed (every process's slowest), so that every
process runs the same program at the same step. A step torch cannot compile (a layer whose
Python it cannot trace, such as Keras's torch random ops, which seed a `torch.Generator`
from a tensor) runs eagerly from then on, with one note that says why.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
import weakref

import keras

from keras_accel.adapter import choice as choices
from keras_accel.adapter import steps as step_values
from keras_accel.utils import keras_internals

KINDS = ("train", "test")
NAMES = {"plain": "eagerly, as Keras's torch trainer does", "compiled": "as one compiled program"}


def install(patches, model, agree=None) -> None:
    """Give `model` compiled train and test steps for the duration of `patches` (the steps
    Keras's trainer defines only; see the module docstring), where its `Choice` takes them.
    `agree`: over several processes, what makes every process's measurements the same
    (`keras_accel.adapter.backends.torch.agree_max`)."""
    if getattr(model, "run_eagerly", False):
        return
    for kind in KINDS:
        if step_values.overrides(model, kind):
            continue
        eager = getattr(model, f"{kind}_step")
        patches.set(model, f"{kind}_step", CompiledStep(model, kind, eager, agree))


# Each model's compiled steps, by kind, kept across calls: torch's compiler reuses a
# program while what it read (the model, its optimizer, our installs) passes its guards.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Each model's `Choice`s, by kind and input signature, kept across its calls.
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CompiledStep:
    """`model.<kind>_step(data)`: Keras's step, compiled (see the module docstring)."""

    def __init__(self, model, kind: str, eager, agree=None):
        self.model_ref = weakref.ref(model)
        self.kind = kind
        self.eager = eager
        self.agree = agree
        self._last = None  # (signature, Choice) of the last step.
        self.eager_steps = 0
        self.program = None
        self.no_gradient: tuple[bool, ...] | None = None
        # The variables' tensors, detached, read once per call (Keras's `assign` writes a
        # variable's tensor in place, so they stay the variables'): the program's gradient
        # is `torch.func`'s, and inputs that required one would wrap the whole program
        # for a backward pass that never comes. The program writes its new values there.
        self.tensors: list | None = None

    def __call__(self, data):
        model = self.model_ref()
        if model is None or self.eager_steps == 0:
            return self._eager(model, data)  # This call's first step builds what Keras builds.
        if step_values.REPLICATED.get():
            # The short last batch every process runs whole, once an epoch, without the
            # program's collectives: eagerly, as Keras's torch trainer runs it.
            return self._eager(model, data)
        choice = self._choice(model, data)
        path, _ = choice.unit(1)
        timed = choice.timed()
        started = choices.clock() if timed else 0.0
        if path == choices.PLAIN:
            result = self._eager(model, data)
        else:
            try:
                result = self._compiled(model, data)
            except Exception as error:  # torch's compiler's errors have no common base.
                if os.environ.get("KA_DEBUG") or not _is_compile_error(error):
                    raise
                choice.failed(error)
                _note_failure(model, self.kind, error)
                return self._eager(model, data)
        if timed:
            _wait(result)
            choice.record(path, choices.clock() - started, 1)
        return result

    def _choice(self, model, data):
        # The key: shapes and dtype objects, asked at every step (names only for a new one).
        signature = tuple(
            (tuple(leaf.shape), leaf.dtype)
            for leaf in keras.tree.flatten(data)
            if hasattr(leaf, "shape")
        )
        if self._last is not None and self._last[0] == signature:
            return self._last[1]
        kept = _CHOICES.setdefault(model, {})
        choice = kept.get((self.kind, signature))
        if choice is None:
            from keras_accel.adapter import choice_cache
            from keras_accel.utils import process
            from keras_accel.utils.printing import print_msg

            details = {
                "device": str(model.trainable_variables[0].value.device)
                if model.trainable_variables
                else "cpu",
                "threads": _threads(),
                "processes": process.num_processes(),
            }
            described = [[list(shape), str(dtype)] for shape, dtype in signature]
            model_ref, kind = self.model_ref, self.kind
            choice = kept[(self.kind, signature)] = choices.Choice(
                "torch",
                NAMES,
                model,
                self.kind,
                fingerprint=lambda: choice_cache.fingerprint(model_ref(), kind, described, details),
                agree=self.agree,
                announce=print_msg,
            )
        self._last = (signature, choice)
        return choice

    def _compiled(self, model, data):
        if self.tensors is None:
            self.tensors = [[v.value.detach() for v in g] for g in _variable_groups(model)]
        if self.program is None:
            programs = _PROGRAMS.setdefault(model, {})
            if self.kind not in programs:
                programs[self.kind] = _program(model, self.kind)
            self.program = programs[self.kind]
        mask, count, ranked = (
            step_values.ROW_MASK.get(),
            step_values.ROW_COUNT.get(),
            step_values.LOSS_RANKED.get(),
        )
        count = None if count is None else count()
        with warnings.catch_warnings():
            # torch's compiler's notes on Keras's code (an `lru_cache` it traces through)
            # are not the user's to act on.
            warnings.filterwarnings("ignore", message=".*Dynamo detected.*")
            return self.program(self.tensors, data, mask, count, ranked, self.no_gradient)

    def _eager(self, model, data):
        # Which weights Keras's eager step gives no gradient (None, where the loss does not
        # reach them); `torch.func` would give them zeros, which Adam's moments would still
        # move. Read from the gradients Keras's step hands its optimizer: Keras 3.15 takes
        # them from `.grad` after `backward()`, 3.16 from `torch.autograd.grad` under
        # `jit_compile=True`, which leaves every `.grad` None.
        record = self.kind == "train" and self.no_gradient is None and model is not None
        with _gradients_applied(model.optimizer if record else None) as applied:
            result = self.eager(data)
        self.eager_steps += 1
        if record:
            self.no_gradient = _no_gradient(model.trainable_variables, applied)
        return result


def _wait(result) -> None:
    """Until a step's results exist (a GPU runs it after the call returns)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _no_gradient(variables, applied) -> tuple[bool, ...]:
    """For each of `variables`, whether the optimizer's `apply` calls `applied` (a step may
    make several, each with some of the weights) never gave it a gradient. Where a call did
    not say its variables (`apply(grads)`: the optimizer's own list) or none was made, what
    `backward()` left in `.grad`, if it left anything; else every weight has one."""
    if applied and all(listed is not None for _, listed in applied):
        given = {id(v) for grads, listed in applied for g, v in zip(grads, listed) if g is not None}
        return tuple(id(v) not in given for v in variables)
    left = tuple(v.value.grad is None for v in variables)
    return left if not all(left) else tuple(False for _ in variables)


@contextlib.contextmanager
def _gradients_applied(optimizer):
    """Within: each `optimizer.apply(grads, variables)` call's lists (variables None where
    not given), recorded in the list yielded (the optimizer's own `apply` still runs). The
    optimizer is as it was after."""
    applied: list = []
    if optimizer is None:
        yield applied
        return
    had = "apply" in vars(optimizer)
    own = vars(optimizer).get("apply")
    original = optimizer.apply

    def apply(grads, trainable_variables=None):
        listed = None if trainable_variables is None else list(trainable_variables)
        applied.append((list(grads), listed))
        return original(grads, trainable_variables)

    optimizer.apply = apply
    try:
        yield applied
    finally:
        if had:
            optimizer.apply = own
        else:
            del optimizer.apply


def _variable_groups(model) -> list[list]:
    optimizer = getattr(model, "optimizer", None)
    return [
        list(model.trainable_variables),
        list(model.non_trainable_variables),
        list(optimizer.variables) if optimizer is not None else [],
        list(model.metrics_variables),
    ]


def _is_compile_error(error: Exception) -> bool:
    """Whether `error` came from torch's compiler (not from the user's step: that one the
    eager step raises again, as plain Keras would)."""
    module = type(error).__module__ or ""
    return module.startswith("torch._dynamo") or module.startswith("torch._inductor")


def _note_failure(model, kind: str, error: Exception) -> None:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    warnings.warn(
        f"keras_accel: the {kind} step of model '{model.name}' could not be compiled by "
        f"torch.compile ({type(error).__name__}: {first}); it runs eagerly, as Keras's "
        "torch trainer runs it, with the same numbers. Set KERAS_ACCEL_JIT_COMPILE=0 to "
        "skip compiling.",
        stacklevel=3,
    )


_COUNT = [0]


def _program(model, kind: str):
    """The compiled step of `kind` for `model`: a function of its own (a code object of
    its own, so that torch's compiler keeps its compilations apart from other models')."""
    import torch

    body = _train if kind == "train" else _test
    _COUNT[0] += 1
    code = body.__code__.replace(co_name=f"{body.__name__}_{model.name}_{_COUNT[0]}")
    function = types.FunctionType(code, body.__globals__, code.co_name)
    model_ref = weakref.ref(model)

    def run(groups, data, mask, count, ranked, no_gradient):
        return compiled(model_ref(), groups, data, mask, count, ranked, no_gradient)

    compiled = torch.compile(function, fullgraph=True, dynamic=False)
    return run


def _publish(mask, count, ranked) -> None:
    """The step's values for `StepValue.get` while torch traces (ContextVars it cannot)."""
    traced = step_values.TRACED
    traced.row_mask = mask
    traced.row_count = None if count is None else (lambda: count)
    traced.loss_ranked = ranked
    traced.active = True


def _unpublish() -> None:
    traced = step_values.TRACED
    traced.active = False
    traced.row_mask = traced.row_count = None
    traced.loss_ranked = False


def _train(model, groups, data, mask, count, ranked, no_gradient):
    import torch

    _publish(mask, count, ranked)
    trainable_values, non_trainable_values, optimizer_values, metric_values = groups
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    optimizer = model.optimizer

    def loss_of(trainable):
        y_pred, loss, non_trainable, metrics = _forward(
            model, (trainable, non_trainable_values, metric_values), x, y, sample_weight, True
        )
        with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, optimizer_values))):
            scaled = optimizer.scale_loss(loss)
        return scaled, (loss, y_pred, non_trainable, metrics)

    grads, (_, (loss, y_pred, non_trainable, metrics)) = torch.func.grad_and_value(
        loss_of, has_aux=True
    )(trainable_values)
    trainable, optimizer_values = _apply(
        model, optimizer_values, grads, trainable_values, no_gradient
    )
    logs, metrics = _update_metrics(model, metrics, loss, x, y, y_pred, sample_weight)
    _write(groups, (trainable, non_trainable, optimizer_values, metrics))
    _unpublish()
    return logs


def _apply(model, optimizer_values, grads, trainable_values, no_gradient):
    """`optimizer.stateless_apply`, but for the weights Keras's eager step gives no gradient
    (`no_gradient`): left out, as Keras's `apply` leaves them out (its warning about them,
    which torch cannot trace, came with the call's first, eager, step)."""
    optimizer, variables = model.optimizer, model.trainable_variables
    mapping = list(zip(optimizer.variables, optimizer_values))
    mapping += list(zip(variables, trainable_values))
    kept = [i for i in range(len(variables)) if not (no_gradient and no_gradient[i])]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        optimizer.apply([grads[i] for i in kept], [variables[i] for i in kept])
    trainable = [scope.get_current_value(v) for v in variables]
    return trainable, [scope.get_current_value(v) for v in optimizer.variables]


def _test(model, groups, data, mask, count, ranked, no_gradient):
    _publish(mask, count, ranked)
    trainable_values, non_trainable_values, optimizer_values, metric_values = groups
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred, loss, non_trainable, metrics = _forward(
        model, (trainable_values, non_trainable_values, metric_values), x, y, sample_weight, False
    )
    logs, metrics = _update_metrics(model, metrics, loss, x, y, y_pred, sample_weight)
    _write(groups, (trainable_values, non_trainable, optimizer_values, metrics))
    _unpublish()
    return logs


def _forward(model, values, x, y, sample_weight, training: bool):
    """Keras's step's forward pass and loss (`_compute_loss`) on the variables' `values`
    (trainable, non-trainable, metrics): the prediction, the loss, and the new non-trainable
    and metric values."""
    trainable, non_trainable, metrics = values
    mapping = list(zip(model.trainable_variables, trainable))
    mapping += list(zip(model.non_trainable_variables, non_trainable))
    mapping += list(zip(model.metrics_variables, metrics))
    kwargs = {"training": training} if keras_internals.call_has_training_arg(model) else {}
    # The losses the layers add (`add_loss`) are collected in the scope, where `model.losses`
    # reads them for the loss; without `collect_losses` a stateless call drops them.
    with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        y_pred = model(x, **kwargs)
        loss = keras_internals.compute_loss_of(model)(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
    non_trainable = [scope.get_current_value(v) for v in model.non_trainable_variables]
    metrics = [scope.get_current_value(v) for v in model.metrics_variables]
    return y_pred, loss, non_trainable, metrics


def _update_metrics(model, metric_values, loss, x, y, y_pred, sample_weight):
    """Keras's torch step's metric updates (the loss tracker by the batch's rows, then
    `compute_metrics`), on `metric_values`: the logs and the new values."""
    mapping = list(zip(model.metrics_variables, metric_values))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        rows = next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
        keras_internals.loss_tracker(model).update_state(loss, sample_weight=rows)
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    values = []
    for variable, value in zip(model.metrics_variables, metric_values):
        new = scope.get_current_value(variable)
        values.append(value if new is None else new)
    return logs, values


def _write(groups, new_groups) -> None:
    """The new values into the variables' own tensors, in place (the compiled program
    writes its inputs; Keras's variables keep their tensors, as `assign` does)."""
    import torch

    with torch.no_grad():
        for old, new in zip(groups, new_groups):
            for tensor, value in zip(old, new):
                if value is not None and value is not tensor:
                    tensor.copy_(value)
