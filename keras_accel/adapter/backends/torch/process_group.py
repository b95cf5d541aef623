"""The torch process group: joining it once (`connect`), this process's rank and the group's
size, what every process agrees on (`agree_seed`, `agree_all`, `agree_max`), and the
devices it offers (`inventory`: one per process).

One process per device, as torch does it: the strategies' runtimes
(`keras_accel.adapter.backends.torch.runtime`, `.data_parallel`) read the group here.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import warnings

import numpy as np

# A process whose peers stop answering fails after this many seconds (a collective's
# timeout, and the wait for every process to join), as JAX's heartbeat does.
TIMEOUT_S = int(os.environ.get("KERAS_ACCEL_HEARTBEAT_TIMEOUT", "100"))


def dist():
    """`torch.distributed`, imported when first needed."""
    import torch.distributed

    return torch.distributed


def joined() -> bool:
    """Whether this process is in a process group."""
    distributed = dist()
    return distributed.is_available() and distributed.is_initialized()


def world() -> int:
    """The process group's size (1 without one)."""
    return dist().get_world_size() if joined() else 1


def mesh(axis: str):
    """A one-axis `DeviceMesh` named `axis` over every process of the group, one device
    each (CUDA where there is one, else the CPU): what torch's sharding strategies split
    variables over."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (world(),), mesh_dim_names=(axis,))


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist().get_rank() if joined() else 0


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

    distributed = dist()
    if cluster is None or joined():
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
        distributed.init_process_group(
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
    distributed = dist()
    if distributed.is_initialized():
        try:
            distributed.destroy_process_group()
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
    dist().broadcast(value, src=0)
    return int(value.item())


def agree_all(flag: bool) -> bool:
    """True where `flag` is true in every process."""
    import torch

    if world() == 1:
        return bool(flag)
    value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=_collective_device())
    dist().all_reduce(value, op=dist().ReduceOp.MIN)
    return bool(value.item())


def agree_max(values: list[float]) -> list[float]:
    """Every process's elementwise maximum of `values` (the same list length everywhere)."""
    import torch

    if world() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist().all_reduce(tensor, op=dist().ReduceOp.MAX)
    return [float(v) for v in tensor.cpu()]


def _collective_device():
    import torch

    if joined() and dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    """One device per process: in a process group, one entry per process (`gpu:r` or
    `cpu:r` for rank r); without one, this process's device. A single process that sees
    several GPUs says once how to use them all."""
    import torch

    size = world()
    if torch.cuda.is_available():
        if size == 1 and torch.cuda.device_count() > 1:
            _note_several_gpus(torch.cuda.device_count())
        return {"gpu": [f"gpu:{r}" for r in range(size)], "cpu": ["cpu:0"]}
    return {"cpu": [f"cpu:{r}" for r in range(size)]}


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
