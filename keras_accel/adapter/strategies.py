"""The strategy registry, and the one function that turns a name plus the visible devices
into a plan.

A `Plan` is backend-neutral (Keras's DeviceMesh idea): which devices, arranged how. Each
strategy name has one entry in `STRATEGIES`, and each backend registers, per name, two
things (the shape of Lightning Fabric's strategy registry):

- the builder that turns a `Plan` into that backend's object: a `keras.distribution`
  Distribution on JAX, a `tf.distribute` strategy on TensorFlow, the process group on
  torch (None for one device);
- the runtime class that runs it (`keras_accel.adapter.runtime.Runtime`): what the
  strategy does at each call, so that a strategy's behaviour is a class of its own, not a
  test of its name inside one runtime. A name with none on a backend (a user's own
  strategy) runs under that backend's base runtime.

A strategy is one module under its backend's package, holding both (e.g.
`keras_accel/adapter/backends/tensorflow/multi_worker.py`,
`keras_accel/adapter/backends/torch/data_parallel.py`). A backend registers them when it
is imported (`keras_accel.adapter.backends.load`), so naming a strategy imports no
backend.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from collections.abc import Callable

# A builder: (plan, layout_map) -> the backend's distribution object, or None for one device.
Builder = Callable[["Plan", object], object]

MESHES = ("data", "data_model")


@dataclasses.dataclass
class Strategy:
    """One registered strategy.

    Attributes:
        name: what `Accelerator(strategy=...)` takes.
        description: one line, listed by errors and `keras-accel env`.
        mesh: "data" (one axis: every device holds a replica) or "data_model" (a
            `(data, model)` mesh from `mesh_shape`, variables laid out by a `LayoutMap`).
        platform: the platform it needs ("tpu"), or None for the first one with devices.
        devices_on: for a "data_model" mesh without `mesh_shape`, the axis that gets every
            device: "model" (`model_parallel`: (1, N)) or "data" (`fsdp`: (N, 1)).
        builders: backend name -> `Builder`, filled in by the backends.
        runtimes: backend name -> the `Runtime` subclass that runs it there, filled in by
            the backends; a backend missing here runs it under its base runtime.
        runs_on: the backends whose modules build it (for a built-in strategy), named by
            errors before those modules are imported: each registers its builders only
            when it loads, and one process loads one backend.
    """

    name: str
    description: str
    mesh: str = "data"
    platform: str | None = None
    devices_on: str = "model"
    builders: dict[str, Builder] = dataclasses.field(default_factory=dict)
    runtimes: dict[str, type] = dataclasses.field(default_factory=dict)
    runs_on: tuple[str, ...] = ()


class StrategyRegistry(collections.abc.Mapping):
    """Strategy names -> their descriptions (what `keras_accel.STRATEGIES` lists), each an
    entry with a builder per backend.

    Example:

    >>> import keras_accel
    >>> "data_parallel" in keras_accel.STRATEGIES
    True
    >>> keras_accel.STRATEGIES.entry("model_parallel").mesh
    'data_model'
    """

    def __init__(self):
        self._entries: dict[str, Strategy] = {}

    def __getitem__(self, name: str) -> str:
        return self._entries[name].description

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def register(
        self,
        name: str,
        description: str,
        *,
        mesh: str = "data",
        platform: str | None = None,
        devices_on: str = "model",
        override: bool = False,
        **builders: Builder,
    ) -> Strategy:
        """Add a strategy, with builders by backend name (`jax=`, `tensorflow=`); more
        builders can follow with `builder`. A name is registered once unless `override`.

        Example, a data-parallel strategy of one's own on JAX:

        >>> import keras_accel
        >>> from keras import distribution
        >>> def mine(plan, layout_map):  # Over the plan's devices: the Accelerator checks.
        ...     return distribution.DataParallel(devices=list(plan.devices))
        >>> entry = keras_accel.STRATEGIES.register(
        ...     "my_data_parallel", "data parallel, built by me", jax=mine
        ... )
        >>> keras_accel.STRATEGIES.unregister("my_data_parallel")
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"A strategy name must be an identifier such as 'my_strategy'. Received: "
                f"name={name!r}"
            )
        if name in self._entries and not override:
            raise ValueError(
                f"Strategy {name!r} is already registered ({self._entries[name].description}). "
                "Pass override=True to replace it, or choose another name."
            )
        if mesh not in MESHES:
            raise ValueError(f"`mesh` must be one of {MESHES}. Received: mesh={mesh!r}")
        if devices_on not in ("model", "data"):
            raise ValueError(
                f"`devices_on` must be 'model' or 'data'. Received: devices_on={devices_on!r}"
            )
        entry = Strategy(name, description, mesh, platform, devices_on)
        if name in self._entries:  # An override keeps the builders it does not replace.
            entry.builders.update(self._entries[name].builders)
            entry.runtimes.update(self._entries[name].runtimes)
            entry.runs_on = self._entries[name].runs_on
        self._entries[name] = entry
        for backend, build in builders.items():
            self.builder(name, backend)(build)
        return entry

    def unregister(self, name: str) -> None:
        """Remove a strategy `register` added (the built-in ones stay)."""
        if name in BUILT_IN:
            raise ValueError(f"{name!r} is built in and cannot be unregistered.")
        self.entry(name)
        del self._entries[name]

    def builder(
        self, name: str, backend: str, default: bool = False
    ) -> Callable[[Builder], Builder]:
        """A decorator: `function` builds strategy `name` on `backend`. `default`: only where
        none is registered yet (how the backends register theirs when they load, so that a
        user's builder, registered before or after, always wins)."""
        entry = self.entry(name)

        def register(function: Builder) -> Builder:
            if not callable(function):
                raise TypeError(
                    f"A builder must be callable as builder(plan, layout_map). Received: "
                    f"{function!r} for {backend}={name!r}"
                )
            if not (default and backend in entry.builders):
                entry.builders[backend] = function
            return function

        return register

    def runtime(self, name: str, backend: str, default: bool = False) -> Callable[[type], type]:
        """A class decorator: the class runs strategy `name` on `backend` (a subclass of
        that backend's `Runtime`, built as `cls(plan, native)` around what the builder
        made). `default`: only where none is registered yet, as for `builder`.

        Example, how a backend's strategy module registers its runtime beside its builder
        (`keras_accel/adapter/backends/tensorflow/multi_worker.py`):

            @STRATEGIES.builder("multi_worker", "tensorflow", default=True)
            def _multi_worker(plan, layout_map): ...

            @STRATEGIES.runtime("multi_worker", "tensorflow", default=True)
            class MultiWorkerRuntime(Runtime): ...
        """
        entry = self.entry(name)

        def register(cls: type) -> type:
            if not isinstance(cls, type):
                raise TypeError(
                    f"A runtime must be a class (a subclass of the backend's Runtime). "
                    f"Received: {cls!r} for {backend}={name!r}"
                )
            if not (default and backend in entry.runtimes):
                entry.runtimes[backend] = cls
            return cls

        return register

    def runtime_class(self, name: str, backend: str, base: type) -> type:
        """The runtime class of strategy `name` on `backend`: the one registered, else
        `base` (the backend's base runtime, which runs a user's own strategy)."""
        return self.entry(name).runtimes.get(backend, base)

    def entry(self, name: str) -> Strategy:
        """The entry of `name`; an unknown name lists the valid ones."""
        if not isinstance(name, str) or name not in self._entries:
            valid = ", ".join(repr(n) for n in self._entries)
            raise ValueError(
                f"Unknown strategy. Received: strategy={name!r}. Valid names: {valid}."
            )
        return self._entries[name]

    def build(self, plan: Plan, backend: str, layout_map=None):
        """The backend's distribution object for `plan` (None: one device, no strategy)."""
        entry = self.entry(plan.strategy)
        if layout_map is not None and entry.mesh != "data_model":
            takes = [n for n, e in self._entries.items() if e.mesh == "data_model"]
            raise ValueError(
                f"layout_map is only used by a strategy with a (data, model) mesh "
                f"({', '.join(repr(n) for n in takes)}). Received: strategy={plan.strategy!r} "
                "with a layout_map."
            )
        build = entry.builders.get(backend)
        if build is None:
            on = sorted(set(entry.builders) | set(entry.runs_on)) or ["none"]
            raise ValueError(
                f"strategy={plan.strategy!r} has no builder for KERAS_BACKEND={backend}; it "
                f"builds on: {', '.join(on)}. Use one of those backends, or register a "
                f"builder with keras_accel.STRATEGIES.builder({plan.strategy!r}, {backend!r})."
            )
        return build(plan, layout_map)


def check_built(plan: Plan, native, replicas: int | None, devices: int | None) -> None:
    """A builder's object must span the plan: `replicas` data-parallel replicas over
    `devices` devices (as the backend reads them off `native`; None: not read)."""
    if native is None and len(plan.devices) == 1:
        return
    wrong = (replicas is not None and replicas != plan.num_replicas) or (
        devices is not None and devices != len(plan.devices)
    )
    if wrong:
        raise ValueError(
            f"The builder of strategy={plan.strategy!r} made a {type(native).__name__} with "
            f"{replicas} replica(s) over {devices} device(s), but the plan has "
            f"{plan.num_replicas} replica(s) over {len(plan.devices)} device(s) "
            f"({', '.join(plan.devices)}); batches are split and padded by the plan. Build "
            "over `plan.devices` with `plan.mesh_shape`, or pass Accelerator(devices=...) to "
            "choose fewer devices."
        )


STRATEGIES = StrategyRegistry()
STRATEGIES.register("auto", "pick the best available: TPU > several GPUs > one GPU > CPU devices")
STRATEGIES.register("single", "one device, no distribution")
STRATEGIES.register(
    "data_parallel", "replicate the model, split each batch over all chosen devices"
)
STRATEGIES.register(
    "mirrored", "data parallel (the tf.distribute name; same as data_parallel on JAX)"
)
STRATEGIES.register(
    "model_parallel",
    "variables laid out by a LayoutMap over a model axis (JAX: a (batch, model) device "
    "mesh; torch: over processes, FSDP2)",
    mesh="data_model",
)
STRATEGIES.register(
    "fsdp",
    "fully sharded data parallel: every variable split over the data axis (JAX: optionally "
    "a (data, model) mesh with a LayoutMap; torch: over processes, FSDP2)",
    mesh="data_model",
    devices_on="data",
)
STRATEGIES.register(
    "tpu",
    "data parallel over TPU cores (TPUStrategy on TF, TPU devices on JAX)",
    platform="tpu",
)
STRATEGIES.register(
    "multi_worker",
    "data parallel over every process of a cluster (TF: MultiWorkerMirroredStrategy, what "
    "auto picks under a multi-worker TF_CONFIG; JAX: data_parallel)",
)
BUILT_IN = frozenset(STRATEGIES)
# The backends that build each built-in name (TensorFlow's model_parallel and fsdp builders
# only refuse, naming the backends that build them).
_EVERY_BACKEND = ("jax", "tensorflow", "torch")
for _name, _on in {
    "single": _EVERY_BACKEND,
    "data_parallel": _EVERY_BACKEND,
    "mirrored": ("jax", "tensorflow"),
    "model_parallel": ("jax", "torch"),
    "fsdp": ("jax", "torch"),
    "tpu": ("jax", "tensorflow"),
    "multi_worker": ("jax", "tensorflow"),
}.items():
    STRATEGIES.entry(_name).runs_on = _on
del _name, _on

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
    return STRATEGIES.entry(name).name


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
    entry = STRATEGIES.entry(strategy)
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
    if entry.platform is not None:
        platform = entry.platform
        if not inventory.get(platform):
            raise RuntimeError(
                f"strategy={strategy!r} but no {platform.upper()} was found. Looked for: "
                f"{', '.join(k for k in inventory) or 'nothing'} devices only. Use "
                f"strategy='auto' to run on what is there, or run where a {platform.upper()} "
                "is attached."
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
    if entry.mesh == "data_model":
        every = (len(chosen), 1) if entry.devices_on == "data" else (1, len(chosen))
        shape = tuple(mesh_shape) if mesh_shape is not None else every
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
