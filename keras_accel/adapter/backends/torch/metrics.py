"""torch over processes: Keras's metrics reported over every process's rows.

Each process updates Keras's metrics with its own rows; what is reported must be the global
batch's. Here:

- **the reduction**: a metric variable's value over the processes, as its `aggregation`
  says (`reduced_values`: one collective per kind and dtype for a whole list), read in a
  `StatelessScope` so that the variables keep their own values (`global_result`, one
  metric; `reduced_once`, every metric of `get_metrics_result()` at once);
- **where**: only inside one of a call's steps (`in_step`), where every process is in the
  same step, so that a collective meets the others; a callback of the chief's reading a
  metric outside a step gets this process's own;
- **when**: a step's logs are reduced only where some process reads them (`StepLogsRead`,
  agreed as each call begins); what Keras reports (the epoch's, the evaluation's results)
  always is.
"""

from __future__ import annotations

import functools
import weakref

import keras

from keras_accel.adapter.steps import overrides_any_step, results_of_state, unreduced


def _dist():
    import torch.distributed as dist

    return dist


# Set while one of the call's steps runs: every process is in the same step then, so a
# collective there meets the others. Outside a step (a callback reading a metric on the
# chief only) results stay this process's own.
IN_STEP: list[int] = [0]


def in_step() -> bool:
    return IN_STEP[0] > 0


# The kinds of the steps running (innermost last); the agreed `StepLogsRead` answers of the
# calls running (innermost last).
STEP_KINDS: list[str] = []
LOGS_READ: list[dict[str, bool]] = []


def logs_read(kind: str) -> bool:
    return not LOGS_READ or LOGS_READ[-1].get(kind, True)


def reduced_once(model, get_metrics_result, local):
    """Keras's `get_metrics_result()` inside a step (its logs, each step) and after the last
    (the epoch's): every metric's state reduced in one collective per dtype, where each
    metric's `result()` would reduce its own variables (two all-reduces per metric). Inside
    a step whose logs no process reads (`StepLogsRead`), each process's own results."""

    def run():
        if not in_step():
            return get_metrics_result()
        if STEP_KINDS and not logs_read(STEP_KINDS[-1]):
            return unreduced(get_metrics_result)
        return results_of_state(
            model.metrics,
            functools.partial(reduced_values, local=local),
            get_metrics_result,
        )

    return run


def global_result(metric, result, local=frozenset()):
    """`metric`'s result over every process's rows (`reduced_values`; the variables whose
    ids are in `local` hold the global state already)."""
    values = reduced_values(metric.variables, local)
    with keras.StatelessScope(state_mapping=list(zip(metric.variables, values))):
        return result()


def reduced_values(variables, local=frozenset()) -> list:
    """Metric variables' values over every process's rows, reduced as their `aggregation`
    says ("sum", Keras's metrics' default; "mean"; "only_first_replica": the chief's), the
    others ("none", and those whose ids are in `local`: users' metrics, updated on the
    global batch by `rows.GatheredMetrics`) left as this process's. The variables keep
    their own values."""
    import torch

    dist = _dist()
    values = [variable.value.detach().clone() for variable in variables]
    # One collective per kind and dtype, in the variables' order (the same in every process).
    groups: dict = {}
    for i, variable in enumerate(variables):
        aggregation = "none" if id(variable) in local else getattr(variable, "aggregation", "sum")
        if aggregation in ("sum", "mean"):
            groups.setdefault(("all_reduce", values[i].dtype), []).append(i)
        elif aggregation == "only_first_replica":
            groups.setdefault(("broadcast", values[i].dtype), []).append(i)
    for (kind, _), indices in groups.items():
        flat = torch.cat([values[i].reshape(-1) for i in indices])
        if kind == "all_reduce":
            dist.all_reduce(flat)
        else:
            dist.broadcast(flat, src=0)
        start = 0
        for i in indices:
            size = values[i].numel()
            values[i] = flat[start : start + size].view_as(values[i])
            start += size
            if getattr(variables[i], "aggregation", "sum") == "mean":
                values[i] = values[i] / dist.get_world_size()
    return values


class MetricState:
    """The metrics' state of `model` in a backup (`RunContext.metric_state`): each process
    holds its own share (Keras's metrics' sums over its rows), which a backup must not
    take from one process. Backed up: the values over every process, as one process
    would hold them (`reduced_values`); restored onto any number of processes: the chief
    holds a summed value, the others zero, so that the processes' states add up to it
    again; every other value (a mean, the chief's, users' metrics, global already) is
    held as it is by every process."""

    def __init__(self, model, local, rank: int):
        """`local()`: the ids of the variables that hold the global state already."""
        self._model = weakref.ref(model)  # The model's own context holds this.
        self._local = local
        self._rank = rank

    def _metrics(self, state: dict) -> list[str]:
        ids = {id(v) for v in self._model().metrics_variables}
        return [key for key, variable in state.items() if id(variable) in ids]

    def for_backup(self, state: dict) -> dict:
        """`state` with the metrics' variables replaced by their values over every process
        (a collective: every process backs up)."""
        keys = self._metrics(state)
        values = reduced_values([state[key] for key in keys], self._local())
        return {**state, **dict(zip(keys, values))}

    def after_restore(self, state: dict) -> None:
        """Each process's share of the metrics' values just restored into `state`."""
        if self._rank == 0:
            return
        local = self._local()
        for key in self._metrics(state):
            variable = state[key]
            if id(variable) not in local and getattr(variable, "aggregation", "sum") == "sum":
                variable.assign(keras.ops.zeros_like(variable.value))


def logs_its_own(model) -> bool:
    """Whether `model`'s class changes what its steps log (its own step, `compute_metrics`
    or `get_metrics_result`): where a step's logs have keys of their own, Keras reports the
    last step's logs as the epoch's (`Trainer._get_metrics_result_or_logs`)."""
    names = ("compute_metrics", "get_metrics_result")
    return overrides_any_step(model) or any(
        getattr(type(model), name, None) is not getattr(keras.Model, name) for name in names
    )


class StepLogsRead(keras.callbacks.Callback):
    """Agrees over the processes, as a call begins, whether any of them reads the logs of
    each step: a batch hook of its callbacks (`callback_list.CallbackList` says which kinds
    have one; a list of another kind is taken to read every kind), or a model whose own
    step, `compute_metrics` or `get_metrics_result` may log keys of its own (Keras then
    reports its last step's logs as the epoch's). Where none does, Keras's own steps
    log each process's own results instead of reducing every metric each step
    (`reduced_once`); what is reported, the epoch's and the evaluation's results, is
    reduced after the last step as always. Runs in every process, where each call's
    callbacks do: its agreement is one collective per kind."""

    def __init__(self, agree_all):
        """`agree_all(flag)`: True where `flag` is true in every process (a collective)."""
        super().__init__()
        self._agree_all = agree_all
        self._hooked: dict[str, bool] | None = None  # Unknown: every kind read.
        self._depth = 0
        self._answer: dict[str, bool] = {}

    def set_batch_hooks(self, hooked: dict[str, bool]) -> None:
        """The kinds whose batch hooks this process's callback list dispatches."""
        self._hooked = dict(hooked)

    def _agreed(self, kinds) -> dict[str, bool]:
        custom = logs_its_own(self.model)
        answer = {}
        for kind in kinds:
            read = custom or self._hooked is None or self._hooked.get(kind, True)
            answer[kind] = not self._agree_all(not read)  # Read by any process.
        return answer

    def _begin(self, kinds) -> None:
        # `fit`'s validation runs inside it, with fit's answer.
        if not self._depth:
            self._answer = self._agreed(kinds)
        self._depth += 1
        LOGS_READ.append(self._answer)

    def _end(self) -> None:
        self._depth -= 1
        if LOGS_READ:
            LOGS_READ.pop()

    def on_train_begin(self, logs=None):
        self._begin(("train", "test"))

    def on_train_end(self, logs=None):
        self._end()

    def on_test_begin(self, logs=None):
        self._begin(("test",))

    def on_test_end(self, logs=None):
        self._end()
