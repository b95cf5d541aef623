"""Is this process one of several? What the environment says, before any device is touched.

A multi-process run is announced by the environment that started it; the Accelerator reads it
here and has the backend join the cluster once, before the first device query (JAX refuses to
join after a computation ran; `tf.distribute` reads `TF_CONFIG` when its strategy is built):

- Keras's own variables (`keras.distribution.initialize` reads them too):
  `KERAS_DISTRIBUTION_JOB_ADDRESSES` (comma-separated `host:port`, the first is the
  coordinator), `KERAS_DISTRIBUTION_NUM_PROCESSES`, `KERAS_DISTRIBUTION_PROCESS_ID`. This is
  what `keras-accel launch` sets, and the way to describe a cluster by hand on JAX.
- The cluster managers JAX detects by itself (`jax.distributed.initialize()` without
  arguments): a Cloud TPU pod slice, SLURM, Open MPI or MPICH with more than one task.
- `TF_CONFIG` naming more than one chief/worker task: TensorFlow's multi-worker description
  (what `MultiWorkerMirroredStrategy` reads).
- On torch, torchrun's `WORLD_SIZE`/`RANK`/`MASTER_ADDR`/`MASTER_PORT` first (what
  `torch.distributed` reads with `env://`; `keras-accel launch` sets them too), then Keras's
  variables, then SLURM (with `MASTER_ADDR`/`MASTER_PORT`).

`KERAS_ACCEL_DISTRIBUTED=0` turns detection off (one process, whatever the environment says);
`=1` joins a cluster even where nothing above is set (JAX then asks its own detectors).
A runtime the user initialized already (`keras.distribution.initialize()` or
`jax.distributed.initialize()` called first) is used as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

from keras_accel.utils import library_internals

SWITCH = "KERAS_ACCEL_DISTRIBUTED"
KERAS_VARIABLES = (
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A multi-process environment, as found.

    Attributes:
        source: what announced it, for messages ("KERAS_DISTRIBUTION_* variables",
            "SLURM", "TF_CONFIG", ...).
        num_processes: the process count where the environment states it, else None (the
            runtime finds out when it joins).
        process_id: this process's index where stated, else None.
        coordinator: the coordinator's `host:port` where stated, else None.
    """

    source: str
    num_processes: int | None = None
    process_id: int | None = None
    coordinator: str | None = None


def _int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer. Received: {name}={raw!r}") from None


def switch() -> bool | None:
    """`KERAS_ACCEL_DISTRIBUTED`: False (0), True (1), or None (auto, the default)."""
    raw = os.environ.get(SWITCH, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(
        f"{SWITCH} must be 0 (one process), 1 (join a cluster) or auto. Received: "
        f"{SWITCH}={os.environ[SWITCH]!r}"
    )


def detect_keras() -> Cluster | None:
    """Keras's `KERAS_DISTRIBUTION_*` variables, validated."""
    if not any(os.environ.get(name) for name in KERAS_VARIABLES):
        return None
    addresses = os.environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES") or None
    count = _int("KERAS_DISTRIBUTION_NUM_PROCESSES")
    index = _int("KERAS_DISTRIBUTION_PROCESS_ID")
    listed = addresses.split(",") if addresses else []
    if count is None and len(listed) > 1:
        count = len(listed)
    if count is not None and count < 1:
        raise ValueError(f"KERAS_DISTRIBUTION_NUM_PROCESSES must be at least 1. Received: {count}")
    if count is not None and index is not None and not 0 <= index < count:
        raise ValueError(
            f"KERAS_DISTRIBUTION_PROCESS_ID must be in [0, {count}) for {count} processes. "
            f"Received: KERAS_DISTRIBUTION_PROCESS_ID={index}"
        )
    if count is not None and len(listed) > 1 and len(listed) != count:
        raise ValueError(
            f"KERAS_DISTRIBUTION_JOB_ADDRESSES lists {len(listed)} addresses but "
            f"KERAS_DISTRIBUTION_NUM_PROCESSES={count}. List one address per process, or "
            "only the coordinator's."
        )
    if count is not None and count > 1 and (not listed or index is None):
        missing = [KERAS_VARIABLES[0]] if not listed else []
        missing += [KERAS_VARIABLES[2]] if index is None else []
        raise ValueError(
            f"{count} processes need a coordinator address and this process's index. "
            f"Missing: {', '.join(missing)}."
        )
    return Cluster(
        "KERAS_DISTRIBUTION_* variables",
        num_processes=count,
        process_id=index,
        coordinator=listed[0] if listed else None,
    )


def detect_jax_managed() -> Cluster | None:
    """A cluster manager that `jax.distributed.initialize()` detects by itself, with more than
    one task (read from the manager's own variables; nothing is contacted)."""
    slurm = _int("SLURM_NTASKS") or _int("SLURM_NPROCS")
    if os.environ.get("SLURM_JOB_ID") and slurm and slurm > 1:
        return Cluster("SLURM", slurm, _int("SLURM_PROCID"))
    ompi = _int("OMPI_COMM_WORLD_SIZE")
    if ompi and ompi > 1:
        return Cluster("Open MPI", ompi, _int("OMPI_COMM_WORLD_RANK"))
    mpich = _int("PMI_SIZE")
    if mpich and mpich > 1:
        return Cluster("MPICH", mpich, _int("PMI_RANK"))
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) > 1 or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return Cluster("Cloud TPU pod", len(hosts) or None, _int("TPU_WORKER_ID"))
    return None


def detect_tf_config() -> Cluster | None:
    """`TF_CONFIG` with more than one chief/worker task."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON. Received: TF_CONFIG={raw!r}") from e
    cluster = config.get("cluster") or {}
    workers = [a for kind in ("chief", "worker") for a in cluster.get(kind, [])]
    if len(workers) < 2:
        return None
    task = config.get("task") or {}
    kind, index = task.get("type"), task.get("index")
    if kind not in ("chief", "worker") or not isinstance(index, int):
        raise ValueError(
            f"TF_CONFIG describes {len(workers)} workers but no valid task for this process: "
            f"task={task!r}. Expected e.g. {{'type': 'worker', 'index': 0}}."
        )
    position = index + (len(cluster.get("chief", [])) if kind == "worker" else 0)
    return Cluster("TF_CONFIG", len(workers), position, workers[0])


TORCH_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


def detect_torchrun() -> Cluster | None:
    """torchrun's (and `torch.distributed`'s `env://`) variables: `WORLD_SIZE`, `RANK`,
    `MASTER_ADDR`, `MASTER_PORT`, validated. `keras-accel launch` sets them too."""
    count = _int("WORLD_SIZE")
    if count is None:
        return None
    index = _int("RANK")
    if count < 1:
        raise ValueError(f"WORLD_SIZE must be at least 1. Received: WORLD_SIZE={count}")
    if count == 1:
        return Cluster("WORLD_SIZE/RANK variables", 1, 0)
    if index is None or not 0 <= index < count:
        raise ValueError(
            f"WORLD_SIZE={count} needs this process's RANK in [0, {count}). Received: "
            f"RANK={os.environ.get('RANK')!r}"
        )
    return Cluster(
        "torchrun's WORLD_SIZE/RANK variables",
        num_processes=count,
        process_id=index,
        coordinator=_master(f"WORLD_SIZE={count}"),
    )


def _master(why: str) -> str:
    """`MASTER_ADDR:MASTER_PORT`, where the process group's store listens."""
    address, port = os.environ.get("MASTER_ADDR"), _int("MASTER_PORT")
    if not address or port is None:
        missing = [n for n, v in (("MASTER_ADDR", address), ("MASTER_PORT", port)) if not v]
        raise ValueError(
            f"{why} describes several torch processes, which meet at MASTER_ADDR:MASTER_PORT "
            f"(the chief's host and a free port). Missing: {', '.join(missing)}. torchrun and "
            "`keras-accel launch` set them."
        )
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port (1-65535). Received: {port}")
    return f"{address}:{port}"


def detect(backend: str) -> Cluster | None:
    """The multi-process environment this process runs in, or None for one process."""
    forced = switch()
    if forced is False:
        return None
    if backend == "jax":
        found = detect_keras() or detect_jax_managed()
        if found is None and forced:
            found = Cluster(f"{SWITCH}=1")
        if found is not None and found.num_processes == 1:
            return None
        return found
    if backend == "tensorflow":
        found = detect_tf_config()
        if found is None and forced:
            raise ValueError(
                f"{SWITCH}=1 with KERAS_BACKEND=tensorflow needs TF_CONFIG naming every "
                "worker: TensorFlow's multi-worker strategies find the cluster there. "
                "`keras-accel launch` sets it for a run on this host."
            )
        return found
    if backend == "torch":
        found = detect_torchrun() or detect_keras()
        if found is None:
            managed = detect_jax_managed()
            if managed is not None and managed.source == "SLURM":
                found = dataclasses.replace(managed, coordinator=_master("SLURM"))
            elif managed is not None:
                found = managed
        if found is None and forced:
            raise ValueError(
                f"{SWITCH}=1 with KERAS_BACKEND=torch needs WORLD_SIZE, RANK, MASTER_ADDR and "
                "MASTER_PORT (torchrun sets them), or `keras-accel launch -n N`."
            )
        if found is not None and found.num_processes == 1:
            return None
        return found
    return None


_exit_hook_installed = False
EXIT_ON_ERROR = "KERAS_ACCEL_EXIT_ON_ERROR"


def exit_on_uncaught_error() -> None:
    """In a multi-process run, an error that ends the script ends the process at once.

    Without this, Python's exit waits for every non-daemon thread, and a checkpoint writer
    (Orbax's) stopped in the middle of its cross-process protocol waits for peers that have
    moved on: the process never exits, its peers never learn, and the run hangs instead of
    failing. Installed once, when the process joins a cluster: the traceback is printed as
    usual, then the process exits with status 1, so that `keras-accel launch` (or the
    cluster manager) sees the failure and stops the others. It stays for the rest of the
    process (`sys.excepthook`); `KERAS_ACCEL_EXIT_ON_ERROR=0` leaves Python's exit as it is,
    for a process that must run its own cleanup after an uncaught error.
    """
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    setting = os.environ.get(EXIT_ON_ERROR, "1").strip()
    if setting not in ("0", "1"):
        raise ValueError(
            f"{EXIT_ON_ERROR} must be 1 (an uncaught error ends a cluster process at once, "
            f"the default) or 0 (Python's own exit). Received: {EXIT_ON_ERROR}={setting!r}"
        )
    if setting == "0":
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        previous(kind, value, traceback)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        library_internals.exit_now(1)

    sys.excepthook = hook
    _exit_hook_installed = True
