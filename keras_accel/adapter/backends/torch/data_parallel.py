"""The `data_parallel` strategy on torch: one process per device over torch.distributed, its
builder (the process group) and its runtime.

Keras's torch trainer runs each step eagerly in Python, so the runtime owns what makes
several processes one training, for the duration of each call, on the instances only:

- **one start**: every process joins one process group (`process_group.connect`: gloo on
  CPUs, NCCL on GPUs, each process on its `LOCAL_RANK` device), draws the chief's seed, and
  begins every `fit` from the chief's variables (`SameStart`, a broadcast);
- **its own rows**: each process feeds its contiguous share of every global batch (the
  feeder's static batches, the same in every process), so every process runs the same steps;
- **one gradient**: the gradients are averaged over the processes before the optimizer's
  `apply` uses them, sent in buckets while the backward pass goes on (`collectives`, as
  `DistributedDataParallel` does; in a compiled step, `compiled`, one all-reduce per dtype
  inside the program), so every process applies the same update, clipping and loss scaling
  included;
- **exact numbers**: a padded batch weights each process's real rows by the global batch's
  real row count (`row_count`), BatchNormalization sums its moments across processes
  (`all_reduce_sum`, differentiable), and Keras's metrics report the state summed over
  every process's rows (`metrics`: every metric's state in one collective per dtype, in a
  step only where a process reads its logs); users' metrics, whose state need not be a
  sum, update on the global batch's rows, gathered (`rows.GatheredMetrics`);
- **one draw**: Dropout and the other per-row random layers draw the global batch's
  numbers while training, as one process does (`rows.GlobalRowDraws`);
- **every prediction**: each batch's outputs are gathered in process order, so `predict`
  returns every row, in order, on every process.

Over one process the base runtime runs it (`keras_accel.adapter.backends.torch.build`).
"""

from __future__ import annotations

import functools

import keras

from keras_accel.adapter.backends.global_rows import FirstReplicaCounts
from keras_accel.adapter.backends.torch import compiled, metrics
from keras_accel.adapter.backends.torch.collectives import (
    GradientBuckets,
    all_reduce_sum,
    averaged_apply,
    broadcast_variables,
    gather_rows,
)
from keras_accel.adapter.backends.torch.metrics import StepLogsRead, in_step
from keras_accel.adapter.backends.torch.process_group import agree_all, agree_max, dist, world
from keras_accel.adapter.backends.torch.rows import GatheredMetrics, GlobalRowDraws
from keras_accel.adapter.backends.torch.runtime import Runtime
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.protocol import run_context
from keras_accel.adapter.steps import install_global_results
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.utils import keras_internals


@STRATEGIES.builder("data_parallel", "torch", default=True)
def _data_parallel(plan: Plan, layout_map):
    """The process group: one replica per process."""
    size = world()
    if plan.num_replicas != size:
        raise ValueError(
            f"On torch data parallelism runs one process per device: {size} process"
            f"{'es' if size > 1 else ''} in the process group, so devices={size}. "
            f"Received: {plan.num_replicas} devices. Start one process per device "
            "(`keras-accel launch -n N`, torchrun)."
        )
    return dist().group.WORLD


@STRATEGIES.runtime("data_parallel", "torch", default=True)
class DataParallelRuntime(Runtime):
    """One process per replica: the call's steps made one training across the process
    group (see the module docstring)."""

    def __init__(self, plan: Plan, native=None):
        super().__init__(plan, native)
        # Keras's torch trainer runs one step per call (3.15 refuses `steps_per_execution`
        # > 1); in one process our step functions run N (`make_function`). Over processes
        # each step's collectives keep the processes in step, one call each.
        self.max_steps_per_execution = 1
        self.all_reduce_sum = all_reduce_sum
        # Each process's gradients are averaged (`averaged_apply`): a sum's is divided.
        self.summed_loss_factor = self.num_replicas
        # The ids of the variables of the users' metrics, global already (`install`).
        self._local: set[int] | frozenset = frozenset()

    @property
    def whole_remainder(self) -> str | None:
        """Every process reads the short last batch whole ("replicate") and runs its step
        on all of its real rows, as one process does, without the collectives that would
        count them once per process (`steps.REPLICATED`); the first process's metric
        updates count (`global_rows.FirstReplicaCounts`)."""
        return "replicate"

    def install_steps(self, patches: Patches, model, training: bool) -> None:
        if training:
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                self.install_gradients(patches, model, optimizer)
        # Per-row random layers (in training; the user's own at every call) draw the global
        # batch's numbers.
        GlobalRowDraws(self.num_replicas, self.rank).install(patches, model)
        # Users' metrics update on the global batch (their state need not be a sum);
        # Keras's own keep theirs and are summed over the processes when read. Installed
        # before the padding masks, which then wrap the gather (its weights are the mask).
        gathered = GatheredMetrics(when=in_step)
        gathered.install_on_model(patches, model)
        # Keras's metrics in a replicated step: the first process's rows count once.
        rank = self.rank
        FirstReplicaCounts(lambda: rank == 0).install_on_model(patches, model)
        self._local = gathered.local
        result = functools.partial(metrics.global_result, local=gathered.local)
        install_global_results(patches, model, result, when=in_step)
        # Keras's steps compiled here too, their collectives (the gradients' average, the
        # metrics' reduction) in the program: the same steps, the same collectives, in every
        # process, which compile alike (the same model, the same shapes). What torch cannot
        # compile (a per-row random layer's draw, BatchNormalization's summed moments, a
        # gathered metric's update) fails in every process alike, and runs eagerly as above.
        # Whether to compile is measured on values every process agrees on (`agree_max`).
        self.install_compiled(patches, model)

    def install_compiled(self, patches: Patches, model) -> None:
        compiled.install(patches, model, agree=agree_max)

    def install_gradients(self, patches: Patches, model, optimizer) -> None:
        """The gradients averaged over the processes before `optimizer.apply` uses them:
        sent in buckets while the backward pass goes on."""
        buckets = GradientBuckets(model.trainable_variables)
        patches.add(buckets.remove)
        patches.set(optimizer, "apply", averaged_apply(optimizer.apply, buckets))

    def install_outer(self, patches: Patches, model) -> None:
        for kind in ("train", "test", "predict"):
            patches.set(model, f"{kind}_step", _stepping(getattr(model, f"{kind}_step"), kind))
        # Keras 3.16 would wrap the model in DistributedDataParallel (a second all-reduce of
        # every gradient) and sum every metric variable itself: not during our calls.
        base_result = keras_internals.step_aside_from_keras_ddp(patches, model)
        # Keras reads the epoch's (and the evaluation's) logs from `get_metrics_result()`
        # after the last step, in every process: global there too.
        result = base_result or model.get_metrics_result
        local = self._local
        reduced = metrics.reduced_once(model, result, local)
        patches.set(model, "get_metrics_result", _stepping(reduced, None))
        # A backup holds the metrics' state over every process, not one process's share.
        state = metrics.MetricState(model, lambda: self._local, self.rank)
        patches.set(run_context(model), "metric_state", state)
        # A call that ends in an error never reaches its callbacks' ends (`StepLogsRead`).
        patches.add(metrics.LOGS_READ.clear)

    def callbacks(self) -> list:
        return [SameStart(), StepLogsRead(agree_all)]

    def row_count(self, row_mask):
        import torch

        # Each process weights its share of the epoch's loss average by the global batch's
        # real rows over the process count: summed over processes, the real rows.
        total = torch.sum(row_mask.to(torch.float32)).reshape(1).detach().clone()
        dist().all_reduce(total)
        return total[0] / self.num_replicas

    def process_rows(self, static_rows: int) -> slice | None:
        """This process's rows of each global batch of `static_rows`."""
        share = static_rows // self.num_replicas
        return slice(self.rank * share, (self.rank + 1) * share)


def _stepping(step, kind: str | None):
    def run(*args):
        metrics.IN_STEP[0] += 1
        if kind is not None:
            metrics.STEP_KINDS.append(kind)
        try:
            result = step(*args)
        finally:
            if kind is not None:
                metrics.STEP_KINDS.pop()
            metrics.IN_STEP[0] -= 1
        if kind == "predict":
            result = gather_rows(result)
        return result

    return run


class SameStart(keras.callbacks.Callback):
    """Every process begins the fit from the chief's variables (model and optimizer, as
    they are when training begins: built, restored): one broadcast per dtype."""

    def on_train_begin(self, logs=None):
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        broadcast_variables(variables)
