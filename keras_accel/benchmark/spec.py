"""What one benchmark configuration is (`RunSpec`), and the checks on what a user asks for.

A `RunSpec` travels to the child process as JSON, so it holds plain values only. Every check
here runs in the parent, before any child starts, and names what it received and what would
work.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterable
from typing import Any

from keras_accel.utils import checks

MODELS: dict[str, str] = {
    "mlp": "the seed's CIFAR-10 MLP (8 Dense-BatchNorm-ReLU-Dropout blocks)",
    "cnn": "the seed's CIFAR-10 CNN ('AlexNet': 5 Conv-BatchNorm-ReLU blocks)",
    "bert": "a small keras-hub BERT text classifier on synthetic sentences",
}

# Keras backend -> the module whose presence means it is installed.
BACKEND_MODULES = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}

MIXED_PRECISION = ("float32", "bfloat16", "float16")
FLOPS_FROM = ("compiled", "hlo", "analytic")

CIFAR10_TRAIN = 50000
# Synthetic data can be any size, but every sample costs 12 KiB of float32 pixels on the host:
# 200,000 samples (4x CIFAR-10) is 2.3 GiB before any copy.
MAX_SYNTHETIC_SAMPLES = 200_000

# The seed's sweep: batch sizes of the TPU-vs-GPU table, the whole CIFAR-10 training set.
SEED_BATCH_SIZES = (256, 1024, 4096, 8192, 16384, 50000)


class BenchInputError(ValueError):
    """What was asked for cannot run: bad arguments, or data that is missing or malformed."""


@dataclasses.dataclass
class RunSpec:
    """One configuration, run in one child process.

    Attributes:
        model: "mlp", "cnn", "bert", or "package.module:function" (a function returning a
            Keras model for CIFAR-10 images, compiled or not).
        backend: the Keras backend of the child.
        batch_size: global batch size.
        samples: training samples per epoch.
        epochs: epochs; the first includes compilation, the best of the others is the
            steady state.
        width: multiplies the widths of the seed MLP/CNN (1.0 is the seed).
        mixed_precision: None/"float32", "bfloat16" or "float16".
        strategy: the Accelerator strategy name.
        devices: how many devices (None: the Accelerator's default; on a CPU, one device).
        data: a CIFAR-10 archive or directory (None: Keras's caches, else synthetic).
        synthetic: True forces synthetic data; None falls back to it when none is found.
        flops_from: "compiled" (XLA cost analysis of the compiled train step), "hlo" (of the
            unoptimized program: no extra compilation) or "analytic" (Dense/Conv count only).
        measure_peak: on a CPU, time a matmul to get the peak FLOP/s.
        peak_tflops: use this peak (per device) instead of the table or the measurement.
        memory_limit_mb: address-space limit (RLIMIT_AS) of the child, for tests and for
            finding limits on a shared host.
        seed: seed of weights, data and shuffling.
    """

    model: str
    backend: str
    batch_size: int
    samples: int
    epochs: int = 3
    width: float = 1.0
    mixed_precision: str | None = None
    strategy: str = "auto"
    devices: int | None = None
    data: str | None = None
    synthetic: bool | None = None
    flops_from: str = "compiled"
    measure_peak: bool = True
    peak_tflops: float | None = None
    memory_limit_mb: int | None = None
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunSpec:
        return cls(**values)


def model_reference(model: str | Callable) -> str:
    """Check a model name or function and return what the child process can import.

    Args:
        model: "mlp", "cnn", "bert", "package.module:function", or a function defined at the
            top level of an importable module.

    Returns:
        The name, or "module:qualname" for a function.

    Example:
        >>> model_reference("mlp")
        'mlp'
        >>> model_reference("resnet")
        Traceback (most recent call last):
        ...
        keras_accel.benchmark.spec.BenchInputError: Unknown model. Received: model='resnet'. ...
    """
    if callable(model):
        module, name = getattr(model, "__module__", None), getattr(model, "__qualname__", "")
        if not module or module == "__main__" or "<" in name:
            raise BenchInputError(
                "A model function must be defined at the top level of an importable module, "
                "because each configuration builds it in a separate process. Received: "
                f"{module}.{name}. Move it into a module, or pass 'package.module:function'."
            )
        return f"{module}:{name}"
    if isinstance(model, str) and (model in MODELS or _is_import_path(model)):
        return model
    valid = ", ".join(MODELS)
    raise BenchInputError(
        f"Unknown model. Received: model={model!r}. Valid models: {valid}, or "
        "'package.module:function' for a function that returns a Keras model."
    )


def _is_import_path(text: str) -> bool:
    module, _, name = text.partition(":")
    parts = module.split(".") + name.split(".")
    return bool(module and name) and all(p.isidentifier() for p in parts)


def parse_batch_sizes(value: str | Iterable[int]) -> tuple[int, ...]:
    """Batch sizes from "256,1024" or a sequence; each must be a positive integer.

    Example:
        >>> parse_batch_sizes("256, 1024,4096")
        (256, 1024, 4096)
        >>> parse_batch_sizes("256,0")
        Traceback (most recent call last):
        ...
        keras_accel.benchmark.spec.BenchInputError: Batch sizes must be positive integers...
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    sizes = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        if isinstance(text, str) and text.isdigit():
            size = int(text)
        elif isinstance(text, int) and not isinstance(text, bool):
            size = text
        else:
            size = 0
        if size < 1:
            raise BenchInputError(
                f"Batch sizes must be positive integers, e.g. 256,1024,4096. Received: "
                f"{value!r} ({item!r} is not a positive integer)."
            )
        if size not in sizes:
            sizes.append(size)
    if not sizes:
        raise BenchInputError(f"Give at least one batch size, e.g. 256,1024. Received: {value!r}")
    return tuple(sizes)


def parse_backends(value: str | Iterable[str]) -> tuple[str, ...]:
    """Backend names from "jax,tensorflow" or a sequence; unknown names are an error.

    A known backend that is not installed is accepted: its column says "not installed".

    Example:
        >>> parse_backends("jax, tensorflow")
        ('jax', 'tensorflow')
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for item in items:
        name = str(item).strip()
        if name not in BACKEND_MODULES:
            raise BenchInputError(
                f"Unknown backend. Received: {name!r} in backends={value!r}. Valid backends: "
                f"{', '.join(BACKEND_MODULES)}."
            )
        if name not in names:
            names.append(name)
    if not names:
        raise BenchInputError(f"Give at least one backend. Received: backends={value!r}")
    return tuple(names)


def backend_installed(name: str) -> bool:
    """Whether a backend's package can be imported here, found without importing it."""
    return importlib.util.find_spec(BACKEND_MODULES[name]) is not None


def check_bench_positive_int(value: Any, name: str) -> int:
    """`value` as an int when it is >= 1, else a BenchInputError naming `name`."""
    return checks.check_positive_int(name, value, BenchInputError)


def check_sweep(
    model: str, batch_sizes: tuple[int, ...], samples: int, epochs: int, synthetic: bool | None
) -> None:
    """The checks that involve several arguments at once."""
    check_bench_positive_int(samples, "samples")
    check_bench_positive_int(epochs, "epochs")
    cap = MAX_SYNTHETIC_SAMPLES
    if samples > cap:
        raise BenchInputError(
            f"Asked for {samples} samples; real CIFAR-10 has {CIFAR10_TRAIN} training images "
            f"and synthetic data is capped at {cap} ({cap * 12 // 1024} MiB of float32 "
            f"pixels). Received: samples={samples}. Use samples <= {CIFAR10_TRAIN}."
        )
    if synthetic is False and samples > CIFAR10_TRAIN and model != "bert":
        raise BenchInputError(
            f"Real CIFAR-10 has {CIFAR10_TRAIN} training images. Received: samples={samples}"
        )
    too_big = [b for b in batch_sizes if b > samples]
    if too_big:
        raise BenchInputError(
            f"Batch sizes {too_big} are larger than samples={samples}: every step would be "
            f"mostly padding. Use samples >= {max(too_big)} or smaller batch sizes."
        )
