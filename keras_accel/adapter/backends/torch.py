"""torch: data parallelism as torch does it, one process per device (`torch.distributed`).

Keras's torch trainer runs each step eagerly in Python, so the Accelerator owns what makes
several processes one training, for the duration of each call, on the instances only:

- **one start**: every process joins one process group (`connect`: gloo on CPUs, NCCL on
  GPUs, each process on its `LOCAL_RANK` device), draws the chief's seed, and begins every
  `fit` from the chief's variables (`SameStart`, a broadcast);
- **its own rows**: each process feeds its contiguous share of every global batch (the
  feeder's static batches, the same in every process), so every process runs the same steps;
- **one gradient**: the gradients are averaged over the processes before the optimizer's
  `apply` uses them, sent in buckets while the backward pass goes on (`torch_collectives`,
  as `DistributedDataParallel` does; in a compiled step, `torch_compiled`, one all-reduce
  per dtype inside the program), so every process applies the same update, clipping and
  loss scaling included;
- **exact numbers**: a padded batch weights each process's real rows by the global batch's
  real row count (`row_count`), BatchNormalization sums its moments across processes
  (`all_reduce_sum`, differentiable), and Keras's metrics report the state summed over
  every process's rows (`torch_metrics`: every metric's state in one collective per dtype,
  in a step only where a process reads its logs);
  users' metrics, whose state need not be a sum, update on the global batch's rows,
  gathered (`torch_rows.GatheredMetrics`);
- **one draw**: Dropout and the other per-row random layers draw the global batch's
  numbers while training, as one process does (`torch_rows.GlobalRowDraws`);
- **every prediction**: each batch's outputs are gathered in process order, so `predict`
  returns every row, in order, on every process.

With one process (no process group) the runtime is one device and adds nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import gc
import os
import warnings
import weakref

import keras
import numpy as np

from keras_accel.adapter import runtime
from keras_accel.adapter.backends import torch_compiled, torch_metrics, torch_rows
from keras_accel.adapter.backends.global_rows import FirstReplicaCounts
from keras_accel.adapter.backends.torch_collectives import (
    GradientBuckets,
    all_reduce_sum,
    averaged_apply,
    broadcast_variables,
    gather_rows,
)
from keras_accel.adapter.backends.torch_metrics import StepLogsRead, in_step
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import install_global_results, overrides_any_step
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.data.pydataset import StaticBatchDataset, stream
from keras_accel.data.sources import ArrayBatches, IterableBatches, PyDatasetBatches
from keras_accel.utils import keras_internals

# A process whose peers stop answering fails after this many seconds (a collective's
# timeout, and the wait for every process to join), as JAX's heartbeat does.
TIMEOUT_S = int(os.environ.get("KERAS_ACCEL_HEARTBEAT_TIMEOUT", "100"))


def _dist():
    import torch.distributed as dist

    return dist


def _joined() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def _world() -> int:
    return _dist().get_world_size() if _joined() else 1


def _rank() -> int:
    return _dist().get_rank() if _joined() else 0


def local_rank() -> int:
    """This process's index on its host (`LOCAL_RANK`, as torchrun and `keras-accel launch`
    set it; 0 where unset)."""
    raw = os.environ.get("LOCAL_RANK", "0") or "0"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer. Received: LOCAL_RANK={raw!r}") from None


def connect(cluster) -> None:
    """Join the process group once, before the first device query.

    The environment the field uses describes the run (`keras_accel.utils.cluster`:
    torchrun's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`, SLURM, `keras-accel
    launch`). gloo on CPUs, NCCL on GPUs (each process on its `LOCAL_RANK` GPU). A process
    group the user initialized already is used as it is. Every process must join within
    `KERAS_ACCEL_HEARTBEAT_TIMEOUT` seconds (100 by default), or each fails saying so.
    """
    import torch

    dist = _dist()
    if cluster is None or _joined():
        return
    if cluster.num_processes is None or cluster.process_id is None or not cluster.coordinator:
        raise ValueError(
            f"The {cluster.source} describe a multi-process run but not all of it: "
            f"processes={cluster.num_processes}, this process={cluster.process_id}, "
            f"coordinator={cluster.coordinator}. torch needs all three: set WORLD_SIZE, RANK, "
            "MASTER_ADDR and MASTER_PORT (torchrun does), or start the script with "
            "`keras-accel launch -n N`."
        )
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    host, _, port = cluster.coordinator.rpartition(":")
    from keras_accel.utils import process

    try:
        # The store as `tcp://` makes it, but bounded where a held port never answers.
        store = process.torch_store(
            host, int(port), cluster.process_id, cluster.num_processes, TIMEOUT_S, cluster.source
        )
        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            store=store,
            world_size=cluster.num_processes,
            rank=cluster.process_id,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        # Ended by us before the interpreter's own teardown, which otherwise destroys
        # gloo's threads while it frees the tensors they hold and aborts the process now
        # and then (SIGABRT, "terminate called without an active exception", after the
        # script's last line; seen under `keras-accel launch -n 2`; pytorch/pytorch#190489).
        atexit.register(_destroy_at_exit)
    except process.StoreUnanswered:
        raise
    except Exception as error:  # torch's DistStoreError, RuntimeError: the text says which.
        text = str(error)
        if "ADDRINUSE" in text or "address already in use" in text.lower():
            raise RuntimeError(
                f"Process {cluster.process_id} of {cluster.num_processes} could not serve the "
                f"process group's store on {cluster.coordinator} ({cluster.source}): the port "
                f"is in use by another program. Choose a free MASTER_PORT, or let "
                f"`keras-accel launch` pick one."
            ) from error
        if "timeout" in text.lower() or "timed out" in text.lower():
            raise RuntimeError(
                f"Process {cluster.process_id} waited {TIMEOUT_S} s for all "
                f"{cluster.num_processes} processes to join the process group at "
                f"{host}:{port} ({cluster.source}); not all came. Start one process per rank "
                f"0..{cluster.num_processes - 1} with the same MASTER_ADDR/MASTER_PORT, or "
                "raise KERAS_ACCEL_HEARTBEAT_TIMEOUT."
            ) from error
        raise


def _destroy_at_exit() -> None:
    """The process group this process joined, destroyed at the interpreter's exit (after its
    threads, a background save's included, were joined), and what held it collected;
    nothing if the script destroyed it."""
    dist = _dist()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
            # What still holds the groups from within reference cycles is freed only by a
            # collection: made now, while the interpreter is whole, the groups' gloo
            # threads are joined here, not in its teardown. Without it a launched custom
            # loop's process still aborted at exit in 5 runs of 15; with it in none of 24.
            gc.collect()
        except Exception as error:  # An exit must not fail on it: say it, go on.
            warnings.warn(
                f"keras_accel: destroying the process group at exit: {error!r}", stacklevel=1
            )


def agree_seed(seed: int | None) -> int:
    """One seed for every process: the chief's (drawn there when `seed` is None)."""
    import torch

    local = np.random.SeedSequence().entropy % 2**31 if seed is None else seed
    value = torch.tensor([int(local)], dtype=torch.int64, device=_collective_device())
    _dist().broadcast(value, src=0)
    return int(value.item())


def agree_all(flag: bool) -> bool:
    """True where `flag` is true in every process."""
    import torch

    if _world() == 1:
        return bool(flag)
    value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=_collective_device())
    _dist().all_reduce(value, op=_dist().ReduceOp.MIN)
    return bool(value.item())


def agree_max(values: list[float]) -> list[float]:
    """Every process's elementwise maximum of `values` (the same list length everywhere)."""
    import torch

    if _world() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    _dist().all_reduce(tensor, op=_dist().ReduceOp.MAX)
    return [float(v) for v in tensor.cpu()]


def _collective_device():
    import torch

    if _joined() and _dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    """One device per process: in a process group, one entry per process (`gpu:r` or
    `cpu:r` for rank r); without one, this process's device. A single process that sees
    several GPUs says once how to use them all."""
    import torch

    world = _world()
    if torch.cuda.is_available():
        if world == 1 and torch.cuda.device_count() > 1:
            _note_several_gpus(torch.cuda.device_count())
        return {"gpu": [f"gpu:{r}" for r in range(world)], "cpu": ["cpu:0"]}
    return {"cpu": [f"cpu:{r}" for r in range(world)]}


_NOTED_GPUS: list[int] = []


def _note_several_gpus(count: int) -> None:
    if _NOTED_GPUS:
        return
    _NOTED_GPUS.append(count)
    warnings.warn(
        f"keras_accel: this process sees {count} GPUs and uses one: on torch, data "
        f"parallelism runs one process per device. Start `keras-accel launch -n {count} "
        f"script.py` (or `torchrun --nproc-per-node {count} script.py`) to use all {count}.",
        stacklevel=3,
    )


@STRATEGIES.builder("single", "torch", default=True)
def _single(plan: Plan, layout_map):
    return None


@STRATEGIES.builder("data_parallel", "torch", default=True)
def _data_parallel(plan: Plan, layout_map):
    """The process group: one replica per process."""
    world = _world()
    if plan.num_replicas != world:
        raise ValueError(
            f"On torch data parallelism runs one process per device: {world} process"
            f"{'es' if world > 1 else ''} in the process group, so devices={world}. "
            f"Received: {plan.num_replicas} devices. Start one process per device "
            "(`keras-accel launch -n N`, torchrun)."
        )
    return _dist().group.WORLD


class Runtime(runtime.Runtime):
    """One process per replica: the call's steps made one training across the process
    group (see the module docstring)."""

    def __init__(self, plan: Plan, native=None):
        super().__init__(plan, native)
        self.rank = _rank()
        # Keras's torch trainer runs one step per call (3.15 refuses `steps_per_execution`
        # > 1); in one process our step functions run N (`make_function`). Over processes
        # each step's collectives keep the processes in step, one call each.
        self.max_steps_per_execution = None if self.num_replicas == 1 else 1
        self.all_reduce_sum = all_reduce_sum if self.num_replicas > 1 else None
        # Each process's gradients are averaged (`averaged_apply`): a sum's is divided.
        self.summed_loss_factor = self.num_replicas
        # The ids of the variables of the users' metrics, global already (`install`).
        self._local: set[int] | frozenset = frozenset()

    @property
    def whole_remainder(self) -> str | None:
        """One process: "whole". Over processes, "replicate": every process reads the short
        last batch whole and runs its step on all of its real rows, as one process does,
        without the collectives that would count them once per process (`steps.
        REPLICATED`); the first process's metric updates count (`global_rows.
        FirstReplicaCounts`)."""
        return "whole" if self.num_replicas == 1 else "replicate"

    def device_scope(self):
        return contextlib.nullcontext()  # Keras places tensors on this process's device.

    def scope(self):
        return contextlib.nullcontext()

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        if first_batch is not None:
            # Keras builds a model from the first batch it reads; ours carries the row mask,
            # which only our step wrappers understand: build from the batch the model's step
            # sees instead, drawing from torch's generator what Keras's read would draw.
            from keras_accel.data.torch_feed import draw_as_keras_reads

            keras_internals.install_symbolic_build(
                patches,
                model,
                first_batch,
                overrides_a_step=overrides_any_step(model),
                skipped_read=draw_as_keras_reads,
            )
        if self.num_replicas == 1:
            if training:  # A padded batch's draws are those of its real rows (torch_rows).
                torch_rows.GlobalRowDraws(1, 0).install(patches, model)
            # One process: Keras's steps compiled, one program each, where measured
            # faster (torch_compiled).
            torch_compiled.install(patches, model)
            return
        if training:
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                buckets = GradientBuckets(model.trainable_variables)
                patches.add(buckets.remove)
                patches.set(optimizer, "apply", averaged_apply(optimizer.apply, buckets))
            # Per-row random layers draw the global batch's numbers (torch_rows).
            torch_rows.GlobalRowDraws(self.num_replicas, self.rank).install(patches, model)
        # Users' metrics update on the global batch (their state need not be a sum);
        # Keras's own keep theirs and are summed over the processes when read. Installed
        # before the padding masks, which then wrap the gather (its weights are the mask).
        gathered = torch_rows.GatheredMetrics(when=in_step)
        gathered.install_on_model(patches, model)
        # Keras's metrics in a replicated step: the first process's rows count once.
        rank = self.rank
        FirstReplicaCounts(lambda: rank == 0).install_on_model(patches, model)
        self._local = gathered.local
        result = functools.partial(torch_metrics.global_result, local=gathered.local)
        install_global_results(patches, model, result, when=in_step)
        # Keras's steps compiled here too, their collectives (the gradients' average, the
        # metrics' reduction) in the program: the same steps, the same collectives, in every
        # process, which compile alike (the same model, the same shapes). What torch cannot
        # compile (a per-row random layer's draw, BatchNormalization's summed moments, a
        # gathered metric's update) fails in every process alike, and runs eagerly as above.
        # Whether to compile is measured on values every process agrees on (`agree_max`).
        torch_compiled.install(patches, model, agree=agree_max)

    def install_outer(self, patches: Patches, model) -> None:
        if self.num_replicas == 1:
            return
        for kind in ("train", "test", "predict"):
            patches.set(model, f"{kind}_step", _stepping(getattr(model, f"{kind}_step"), kind))
        # Keras 3.16 would wrap the model in DistributedDataParallel (a second all-reduce of
        # every gradient) and sum every metric variable itself: not during our calls.
        base_result = keras_internals.step_aside_from_keras_ddp(patches, model)
        # Keras reads the epoch's (and the evaluation's) logs from `get_metrics_result()`
        # after the last step, in every process: global there too.
        result = base_result or model.get_metrics_result
        local = self._local
        reduced = torch_metrics.reduced_once(model, result, local)
        patches.set(model, "get_metrics_result", _stepping(reduced, None))
        # A call that ends in an error never reaches its callbacks' ends (`StepLogsRead`).
        patches.add(torch_metrics.LOGS_READ.clear)

    def callbacks(self) -> list:
        return [SameStart(), StepLogsRead(agree_all)] if self.num_replicas > 1 else []

    def make_function(self, model, kind: str):
        """The call's N steps (`model.steps_per_execution`) one after the other in one host
        call, where Keras's torch trainer refuses N > 1; with N = 1, Keras's own function,
        except under `jit_compile=True`, where Keras's `torch.compile` would trace our eager
        wrappers around the compiled steps (torch_compiled), which compile themselves.

        The steps are Keras's, run as Keras's loop runs them (with no host sync between
        them: the logs stay tensors), so the numbers are those of N = 1; what changes is
        that batch hooks fire once per N steps, as on JAX and TensorFlow (`fusion`)."""
        n = getattr(model, "steps_per_execution", 1) or 1
        compiled = getattr(model, "jit_compile", False) and kind in torch_compiled.KINDS
        if n == 1 and not compiled:
            return None
        model_ref = weakref.ref(model)
        name = f"{kind}_step"

        def steps_on_data(data):
            step = getattr(model_ref(), name)
            if kind == "predict":
                return _concatenated([step(batch) for batch in data])
            logs = None
            for batch in data:
                logs = step(batch)
            return logs

        return steps_on_data

    def row_count(self, row_mask):
        import torch

        # Each process weights its share of the epoch's loss average by the global batch's
        # real rows over the process count: summed over processes, the real rows.
        total = torch.sum(row_mask.to(torch.float32)).reshape(1)
        if self.num_replicas > 1:
            total = total.detach().clone()
            _dist().all_reduce(total)
        return total[0] / self.num_replicas

    def process_rows(self, static_rows: int) -> slice | None:
        """This process's rows of each global batch of `static_rows` (None in one process)."""
        if self.num_replicas == 1:
            return None
        share = static_rows // self.num_replicas
        return slice(self.rank * share, (self.rank + 1) * share)

    # `own_files` and `own_rows`: the runtime's defaults (None). Each process reads a
    # file-backed pipeline or a Grain data set whole and keeps its rows of each batch: where
    # processes read their own files, the end of their data is agreed through JAX's
    # coordinator (`keras_accel.utils.process.EndAgreement`), which a torch run has not.

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        rows = self.process_rows(batches.plan.static_rows)
        own = getattr(batches, "own_files", None)
        if own is not None and carry_mask:
            from keras_accel.data.grain import GrainPasses

            return GrainPasses(own.with_preprocess(preprocess), carry_mask=True)
        if preprocess is not None:
            raise ValueError(
                "On the torch backend keras_accel feeds numbers: a keras-hub preprocessor "
                "runs in tf.data, which Keras's torch trainer reads but keras_accel does not "
                "route there yet. Received: a model with a preprocessor. Preprocess first "
                "(`preprocessor(x)` into arrays), or use KERAS_BACKEND=jax or tensorflow."
            )
        if isinstance(batches, IterableBatches):
            return stream(batches, carry_mask=carry_mask, rows=rows)
        if isinstance(batches, ArrayBatches):
            # In-memory arrays: gathered and converted in the trainer's thread (torch_feed).
            from keras_accel.data.torch_feed import TorchBatches

            return TorchBatches(StaticBatchDataset(batches, carry_mask=carry_mask, rows=rows))
        if isinstance(batches, PyDatasetBatches):
            # A user's PyDataset: read in Keras's worker thread, as Keras reads it.
            return StaticBatchDataset(batches, carry_mask=carry_mask, rows=rows)
        # tf.data inputs: Keras's torch trainer reads them as torch tensors.
        from keras_accel.data import tfdata

        pipeline = batches.pipeline(carry_mask, preprocess)
        return pipeline if rows is None else tfdata.take_rows(pipeline, rows)


def _stepping(step, kind: str | None):
    def run(*args):
        torch_metrics.IN_STEP[0] += 1
        if kind is not None:
            torch_metrics.STEP_KINDS.append(kind)
        try:
            result = step(*args)
        finally:
            if kind is not None:
                torch_metrics.STEP_KINDS.pop()
            torch_metrics.IN_STEP[0] -= 1
        if kind == "predict":
            result = gather_rows(result)
        return result

    return run


# Keras's EpochIterator reads a group of N batches with `__next__` on torch (its other
# trainers read the iterator inside their step function) and warns "Your input ran out of
# data" whenever the data ends inside a group: at every known-length epoch whose last group
# is shorter than N, which is by design (keras.src.trainers.epoch_iterator, 3.15).
_RAN_OUT = r"Your input ran out of data"


def quiet_short_groups(patches) -> None:
    """For the duration of `patches`: no "ran out of data" warning from Keras's epoch
    iterator (a fused call's last group; see `_RAN_OUT`)."""
    warnings.filterwarnings("ignore", message=_RAN_OUT, module=r"keras\.src\.trainers")
    added = warnings.filters[0]

    def remove():
        # An "ignore" leaves nothing in the warnings registries: removing it is enough.
        if added in warnings.filters:
            warnings.filters.remove(added)

    patches.add(remove)


def _concatenated(outputs: list):
    """N steps' predictions as one group's (Keras's loop appends a call's outputs)."""
    if len(outputs) == 1:
        return outputs[0]
    import torch

    return keras.tree.map_structure(lambda *parts: torch.cat(parts, dim=0), *outputs)


class SameStart(keras.callbacks.Callback):
    """Every process begins the fit from the chief's variables (model and optimizer, as
    they are when training begins: built, restored): one broadcast per dtype."""

    def on_train_begin(self, logs=None):
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            variables += list(optimizer.variables)
        broadcast_variables(variables)


def build(plan: Plan, layout_map=None) -> Runtime:
    return Runtime(plan, STRATEGIES.build(plan, "torch", layout_map))


def backend_versions() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "keras": keras.__version__}
