"""torch: one process per device (`torch.distributed`), one module per job.

- `process_group`: joining the process group, ranks, what every process agrees on, and the
  devices (`inventory`: one per process);
- `runtime`: the base `Runtime`, one process on its device (`single`);
- `data_parallel`: the `data_parallel` strategy, its builder and its runtime (each
  process's rows of every batch, one averaged gradient, exact metrics and draws);
- `fsdp`: the `fsdp` strategy, data parallelism whose variables and optimizer slots each
  process holds a shard of (FSDP2, DTensor);
- `model_parallel`: the `model_parallel` strategy, a `LayoutMap`'s variables split over
  the processes (FSDP2, DTensor), each process running the whole batch;
- `collectives`: gradients averaged in buckets during the backward pass, variables
  broadcast, rows gathered;
- `metrics`: Keras's metrics' state reduced over the processes, once per read;
- `rows`: per-row random draws and users' metrics on the global batch;
- `compiled`: Keras's steps compiled (`torch.compile`), where measured faster.

`build` takes each strategy's runtime class from the registry
(`keras_accel.adapter.strategies.STRATEGIES.runtime`); a strategy over one replica (one
process) runs under the base runtime, which adds nothing across processes.
"""

from __future__ import annotations

import keras

# Each strategy's module registers its builder and runtime class when imported.
from keras_accel.adapter.backends.torch import data_parallel, fsdp, model_parallel  # noqa: F401
from keras_accel.adapter.backends.torch.process_group import (
    agree_all,
    agree_max,
    agree_seed,
    connect,
    inventory,
    local_rank,
)
from keras_accel.adapter.backends.torch.runtime import Runtime, quiet_short_groups
from keras_accel.adapter.strategies import STRATEGIES, Plan

__all__ = [
    "Runtime",
    "agree_all",
    "agree_max",
    "agree_seed",
    "backend_versions",
    "build",
    "connect",
    "inventory",
    "local_rank",
    "quiet_short_groups",
]


def build(plan: Plan, layout_map=None) -> Runtime:
    native = STRATEGIES.build(plan, "torch", layout_map)
    if plan.num_replicas * plan.mesh_shape[1] == 1:  # One process: nothing to make one of.
        return Runtime(plan, native)
    # A strategy of a user's own (a builder only) runs over the process group as data
    # parallelism does.
    runtime_class = STRATEGIES.runtime_class(
        plan.strategy, "torch", data_parallel.DataParallelRuntime
    )
    return runtime_class(plan, native)


def backend_versions() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "keras": keras.__version__}
