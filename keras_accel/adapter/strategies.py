"""Strategy names, and the one function that turns a name plus the visible devices into a plan.

A `Plan` is backend-neutral (Keras's DeviceMesh idea): which devices, arranged how. The
backend modules turn it into a `keras.distribution` object or a `tf.distribute` strategy.
"""

from __future__ import annotations

import dataclasses
import math

# name -> what it means; the registry every error message lists.
STRATEGIES: dict[str, str] = {
    "auto": "pick the best available: TPU > several GPUs > one GPU > CPU devices",
    "single": "one device, no distribution",
    "data_parallel": "replicate the model, split each batch over all chosen devices",
    "mirrored": "data parallel (the tf.distribute name; same as data_parallel on JAX)",
    "model_parallel": "JAX only: a (batch, model) device mesh with a LayoutMap",
    "tpu": "data parallel over TPU cores (TPUStrategy on TF, TPU devices on JAX)",
    "multi_worker": "data parallel over every process of a cluster (TF: MultiWorkerMirrored"
    "Strategy, what auto picks under a multi-worker TF_CONFIG; JAX: data_parallel)",
}

PLATFORM_ORDER = ("tpu", "gpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to build: a strategy over devices of one platform.

    Attributes:
        strategy: the resolved strategy name (never "auto").
        platform: "cpu", "gpu" or "tpu".
        devices: device identifiers as the backend names them.
        mesh_shape: (data, model) axis sizes; (len(devices), 1) for pure data parallelism.
    """

    strategy: str
    platform: str
    devices: tuple
    mesh_shape: tuple[int, int]

    @property
    def num_replicas(self) -> int:
        return self.mesh_shape[0]


def check_strategy_name(name: str) -> str:
    if not isinstance(name, str) or name not in STRATEGIES:
        valid = ", ".join(repr(n) for n in STRATEGIES)
        raise ValueError(f"Unknown strategy. Received: strategy={name!r}. Valid names: {valid}.")
    return name


def resolve(
    strategy: str,
    inventory: dict[str, list],
    devices: list | None = None,
    mesh_shape: tuple | None = None,
    workers: int | None = None,
) -> Plan:
    """Turn a strategy name and the device inventory into a `Plan`.

    Args:
        strategy: a name from `STRATEGIES`.
        inventory: platform -> device identifiers, as the backend lists them.
        devices: restrict to these devices (identifiers from the inventory) or to the first
            `devices` of them when an int.
        mesh_shape: for "model_parallel", the (data, model) sizes; their product must equal
            the device count.
        workers: the worker count of a TF multi-worker cluster (TF_CONFIG), else None. Then
            `inventory` lists this worker's devices, and data parallelism spans the workers.
    """
    check_strategy_name(strategy)
    if workers is not None and strategy in ("auto", "data_parallel", "mirrored"):
        strategy = "multi_worker"
    if strategy == "multi_worker":
        if workers is None:
            return resolve("data_parallel", inventory, devices, mesh_shape)
        platform = "gpu" if inventory.get("gpu") else "cpu"
        # MultiWorkerMirroredStrategy computes on each worker's GPUs, else on its CPU.
        local = _choose(list(inventory.get(platform, [])), devices, platform)
        local = local if platform == "gpu" else local[:1]
        replicas = workers * len(local)
        return Plan("multi_worker", platform, tuple(local), (replicas, 1))
    if strategy == "tpu":
        platform = "tpu"
        if not inventory.get("tpu"):
            raise RuntimeError(
                "strategy='tpu' but no TPU was found. Looked for: "
                f"{', '.join(k for k in inventory) or 'nothing'} devices only. Use "
                "strategy='auto' to run on what is there, or run where a TPU is attached."
            )
    else:
        # auto: the first platform that has devices, in the documented order.
        platform = next(p for p in PLATFORM_ORDER if inventory.get(p)) if inventory else "cpu"
    available = list(inventory.get(platform, []))
    chosen = _choose(available, devices, platform)
    if strategy == "auto":
        strategy = "tpu" if platform == "tpu" else "single" if len(chosen) == 1 else "data_parallel"
    if strategy == "single":
        chosen = chosen[:1]
    if strategy == "model_parallel":
        shape = tuple(mesh_shape) if mesh_shape is not None else (1, len(chosen))
    else:
        shape = (len(chosen), 1)
        if mesh_shape is not None and tuple(mesh_shape) not in (shape, (len(chosen),)):
            raise ValueError(
                f"mesh_shape={tuple(mesh_shape)} does not fit strategy={strategy!r} over "
                f"{len(chosen)} devices; data parallelism uses mesh_shape={shape}. Pass "
                "strategy='model_parallel' for a two-axis mesh."
            )
    if len(shape) != 2 or any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(
            f"mesh_shape must be two positive integers (data, model). Received: "
            f"mesh_shape={mesh_shape!r}"
        )
    if math.prod(shape) != len(chosen):
        raise ValueError(
            f"mesh_shape={shape} needs {math.prod(shape)} devices but {len(chosen)} are in use "
            f"({platform}). Pick a shape whose product is {len(chosen)}, e.g. "
            f"{_factor_examples(len(chosen))}."
        )
    return Plan(strategy=strategy, platform=platform, devices=tuple(chosen), mesh_shape=shape)


def _choose(available: list, devices, platform: str) -> list:
    if devices is None:
        return available
    if isinstance(devices, int) and not isinstance(devices, bool):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices} but {len(available)} {platform} devices exist. Pass an "
                f"integer from 1 to {len(available)}, or None for all."
            )
        return available[:devices]
    unknown = [d for d in devices if d not in available]
    if unknown or not devices:
        raise ValueError(
            f"Unknown devices {unknown or devices!r}. Available {platform} devices: {available}."
        )
    return list(devices)


def _factor_examples(n: int) -> str:
    pairs = [(a, n // a) for a in range(1, n + 1) if n % a == 0]
    return ", ".join(str(p) for p in pairs[:4])
