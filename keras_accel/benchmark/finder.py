"""`find_batch_size`: the largest batch that trains without running out of memory.

Doubling from `start` finds a size that fails; bisection between the last size that ran and
the first that failed narrows the limit to `multiple_of`. Every try is a child process, so
each out-of-memory failure is real and leaves nothing behind. The answer keeps a safety
margin below the limit: memory use varies between runs (fragmentation, other processes, a
longer sequence), and a size that barely fits once may not fit the next time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from keras_accel.benchmark import isolate
from keras_accel.benchmark.results import BenchResult
from keras_accel.benchmark.spec import (
    BenchInputError,
    RunSpec,
    backend_installed,
    check_bench_positive_int,
    model_reference,
    parse_backends,
)
from keras_accel.benchmark.sweep import Progress, model_paths


class BatchSizeSearchError(RuntimeError):
    """The search cannot answer: even the smallest size failed, or a try failed otherwise."""


@dataclasses.dataclass
class Try:
    """One trial: a batch size, how it ended, and its measured throughput."""

    batch_size: int
    status: str
    samples_per_second: float | None = None
    error: str | None = None


@dataclasses.dataclass
class BatchSizeResult:
    """What `find_batch_size` found.

    Attributes:
        batch_size: the recommended size: the largest that trained, less the margin,
            rounded down to `multiple_of`.
        samples_per_second: training throughput measured at `batch_size`.
        max_batch_size: the largest size that trained.
        first_oom: the smallest size that ran out of memory (None: none did up to `max`).
        tries: every trial, in order.
        backend: the Keras backend searched.
    """

    batch_size: int
    samples_per_second: float | None
    max_batch_size: int
    first_oom: int | None
    tries: list[Try]
    backend: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        limit = f"OOM from {self.first_oom}" if self.first_oom else "no OOM up to the maximum tried"
        speed = "n/a" if self.samples_per_second is None else f"{self.samples_per_second:,.0f}"
        return (
            f"{self.backend}: batch_size={self.batch_size} ({speed} samples/s); largest that "
            f"trained: {self.max_batch_size}; {limit}; {len(self.tries)} tries"
        )


def search_batch_size(
    trial: Callable[[int], Try], start: int, maximum: int, multiple_of: int
) -> tuple[int, int | None, list[Try]]:
    """Double from `start` until a try runs out of memory, then bisect; pure search logic.

    Args:
        trial: runs one batch size and returns its `Try` (status "ok" or "OOM"; any other
            status stops the search with `BatchSizeSearchError`).
        start: the first size; a multiple of `multiple_of`.
        maximum: the largest size to try.
        multiple_of: granularity; bisection stops when the bracket is this narrow.

    Returns:
        `(largest size that ran, smallest that ran out of memory or None, tries)`.

    Example:
        >>> fits = lambda b: Try(b, "ok" if b <= 1000 else "OOM")
        >>> largest, first_oom, tries = search_batch_size(fits, 64, 4096, 64)
        >>> largest, first_oom, [t.batch_size for t in tries]
        (960, 1024, [64, 128, 256, 512, 1024, 768, 896, 960])
    """
    tries: list[Try] = []

    def attempt(size: int) -> bool:
        result = trial(size)
        tries.append(result)
        if result.status == isolate.OK:
            return True
        if result.status == isolate.OOM:
            return False
        raise BatchSizeSearchError(
            f"Batch size {size} failed with {result.status!r}, not out of memory, so the "
            f"search cannot go on: {result.error}"
        )

    largest, first_oom = None, None
    size = start
    while True:
        if attempt(size):
            largest = size
            if size >= maximum:
                break
            size = min(size * 2, maximum)
        else:
            first_oom = size
            break
    if largest is None:
        raise BatchSizeSearchError(
            f"Even the starting batch size {start} ran out of memory: {tries[-1].error}. "
            f"Pass a smaller start (a multiple of {multiple_of})."
        )
    low, high = largest, first_oom
    while high is not None and high - low > multiple_of:
        middle = (low + high) // 2 // multiple_of * multiple_of
        if middle <= low:
            break
        if attempt(middle):
            low = middle
        else:
            high = middle
    return low, high, tries


def find_batch_size(
    model: str | Callable = "mlp",
    *,
    backend: str | None = None,
    start: int = 64,
    max_batch_size: int = 65536,
    margin: float = 0.1,
    multiple_of: int = 8,
    steps: int = 2,
    width: float = 1.0,
    mixed_precision: str | None = None,
    strategy: str = "auto",
    devices: int | None = None,
    memory_limit_mb: int | None = None,
    timeout_s: float | None = 1800.0,
    measure: bool = True,
    progress: bool = True,
) -> BatchSizeResult:
    """The largest batch size that trains `model` without running out of memory.

    Each try trains `steps` steps per epoch for 2 epochs (the first compiles, the second is
    timed) on synthetic data, in its own child process: an out-of-memory failure is real
    and its memory is fully released before the next try.

    Args:
        model: "mlp", "cnn", "bert", "package.module:function" or a top-level function.
        backend: the Keras backend (default: `$KERAS_BACKEND`, else "jax").
        start: the first size tried; rounded up to `multiple_of`.
        max_batch_size: never try more than this.
        margin: fraction kept free below the largest size that ran: 0.1 recommends 90% of
            it. 0 returns the limit itself.
        multiple_of: granularity of the sizes tried and returned (e.g. 8 or 128 per core).
        steps: steps per timed epoch.
        width, mixed_precision, strategy, devices: as in `run_benchmark`.
        memory_limit_mb: address-space limit of each child process.
        timeout_s: limit per try.
        measure: time the recommended size when it was not one of the tries.
        progress: report each try on stderr.

    Returns:
        A `BatchSizeResult` with the recommended `batch_size` and its `samples_per_second`.

    Raises:
        BatchSizeSearchError: `start` already ran out of memory, or a try failed otherwise.

    Example:
        >>> found = find_batch_size("cnn", start=256, max_batch_size=8192)  # doctest: +SKIP
        >>> found.batch_size, found.samples_per_second  # doctest: +SKIP
        (3584, 20131.5)
    """
    reference = model_reference(model)
    (name,) = parse_backends(backend or os.environ.get("KERAS_BACKEND") or "jax")
    for value, label in (
        (start, "start"),
        (max_batch_size, "max_batch_size"),
        (multiple_of, "multiple_of"),
        (steps, "steps"),
    ):
        check_bench_positive_int(value, label)
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise BenchInputError(f"`margin` must be in [0, 1). Received: margin={margin!r}")
    if not backend_installed(name):
        raise BenchInputError(f"Backend {name!r} is not installed here.")
    start = -(-start // multiple_of) * multiple_of
    maximum = max_batch_size // multiple_of * multiple_of
    if start > maximum:
        raise BenchInputError(
            f"`start` must not exceed `max_batch_size`. Received: start={start}, "
            f"max_batch_size={max_batch_size} (multiple_of={multiple_of})."
        )
    extra_paths = model_paths(model)
    bar = Progress(0, enabled=progress)

    def trial(size: int) -> Try:
        spec = RunSpec(
            model=reference,
            backend=name,
            batch_size=size,
            samples=size * steps,
            epochs=2,
            width=float(width),
            mixed_precision=mixed_precision,
            strategy=strategy,
            devices=devices,
            synthetic=True,  # memory does not depend on the pixels; any size is possible
            flops_from="analytic",
            measure_peak=False,
            memory_limit_mb=memory_limit_mb,
        ).to_dict()
        label = f"find batch size: {name} {reference} batch={size}"
        bar.total += 1
        bar.start(label)
        record = isolate.run_isolated(
            spec, timeout_s=timeout_s, memory_limit_mb=memory_limit_mb, extra_paths=extra_paths
        )
        if record.get("status") == isolate.INPUT_ERROR:
            raise BenchInputError(record.get("error", "the model cannot be made"))
        result = BenchResult.from_record(spec, record)
        bar.finish(label, result.status)
        return Try(size, result.status, result.samples_per_second, record.get("error"))

    largest, first_oom, tries = search_batch_size(trial, start, maximum, multiple_of)
    recommended = max(multiple_of, int(largest * (1 - margin)) // multiple_of * multiple_of)
    measured = {t.batch_size: t for t in tries if t.status == isolate.OK}
    if recommended not in measured and measure:
        extra = trial(recommended)
        tries.append(extra)
        if extra.status == isolate.OK:
            measured[recommended] = extra
    speed = measured[recommended].samples_per_second if recommended in measured else None
    return BatchSizeResult(recommended, speed, largest, first_oom, tries, name)
