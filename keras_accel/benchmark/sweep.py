"""`run_benchmark`: the seed's sweep (model x batch size x backend), one child process each."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Sequence

from keras_accel.benchmark import isolate
from keras_accel.benchmark.results import BenchReport, BenchResult, share_across_rows
from keras_accel.benchmark.spec import (
    FLOPS_FROM,
    MIXED_PRECISION,
    BenchInputError,
    RunSpec,
    backend_installed,
    check_bench_positive_int,
    check_sweep,
    model_reference,
    parse_backends,
    parse_batch_sizes,
)

DEFAULT_TIMEOUT_S = 3600.0


class Progress:
    """One line per configuration on stderr: `[3/8] jax batch=1024 ... ok, 1.05 s/epoch`.

    On a terminal the running line is rewritten in place when it finishes; in a log file
    (CI) each configuration gets a start line and a result line.

    Example:
        >>> import io
        >>> stream = io.StringIO()
        >>> bar = Progress(2, stream=stream)
        >>> bar.start("jax mlp batch=256")
        >>> bar.finish("jax mlp batch=256", "ok")
        >>> stream.getvalue().splitlines()[1]
        '[##########..........] 1/2 jax mlp batch=256: ok (0 s elapsed)'
    """

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.perf_counter()

    def _bar(self) -> str:
        width = 20
        filled = round(width * self.done / max(self.total, 1))
        return "[" + "#" * filled + "." * (width - filled) + f"] {self.done}/{self.total}"

    def start(self, label: str) -> None:
        if not self.enabled:
            return
        text = f"{self._bar()} {label} ..."
        self.stream.write(text if self.tty else text + "\n")
        self.stream.flush()
        self._label = label

    def finish(self, label: str, summary: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.started
        text = f"{self._bar()} {label}: {summary} ({elapsed:.0f} s elapsed)"
        self.stream.write(("\r\x1b[2K" if self.tty else "") + text + "\n")
        self.stream.flush()


def _summary(result: BenchResult, seconds: float) -> str:
    if result.status == isolate.OK:
        steady = result.steady_epoch_seconds
        figure = (
            f"{steady:.3g} s/epoch"
            if steady is not None
            else f"{result.first_epoch_seconds:.3g} s first epoch"
        )
        return f"ok, {figure}, child {seconds:.1f} s"
    return f"{result.status}, child {seconds:.1f} s"


def run_benchmark(
    model: str | Callable = "mlp",
    batch_sizes: str | Iterable[int] = (256, 1024),
    *,
    backends: str | Sequence[str] | None = None,
    epochs: int = 3,
    samples: int = 4096,
    width: float = 1.0,
    mixed_precision: str | None = None,
    strategy: str = "auto",
    devices: int | None = None,
    data: str | None = None,
    synthetic: bool | None = None,
    flops_from: str = "compiled",
    measure_peak: bool = True,
    peak_tflops: float | None = None,
    memory_limit_mb: int | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    progress: bool = True,
) -> BenchReport:
    """Time `model` at each batch size on each backend, each run isolated in a child process.

    Every (backend, batch size) trains for `epochs` epochs through `Accelerator.fit` in a
    new Python process. The first epoch includes compilation; the best of the others is the
    steady state, as the seed measured. A configuration that runs out of memory becomes an
    "OOM" row and the sweep goes on; a backend that is not installed becomes a "not
    installed" column. Data or model problems (a truncated CIFAR-10 file, more samples than
    the data holds) stop the sweep with a `BenchInputError`.

    Args:
        model: "mlp", "cnn", "bert", "package.module:function", or a top-level function
            returning a Keras model for CIFAR-10 images (compiled or not).
        batch_sizes: global batch sizes, as "256,1024" or a sequence.
        backends: Keras backends to compare (default: `$KERAS_BACKEND`, else "jax").
        epochs: epochs per configuration; 2 or more to get a steady state.
        samples: training samples per epoch (CIFAR-10 holds 50000).
        width: width multiplier of the seed MLP/CNN (1.0: the seed's model).
        mixed_precision: None, "float32", "bfloat16" or "float16".
        strategy: an Accelerator strategy name ("auto", "single", "data_parallel", ...).
        devices: device count for the Accelerator; on a CPU, that many virtual devices.
        data: a CIFAR-10 archive or directory; None searches Keras's caches, then falls
            back to synthetic data (every output says so).
        synthetic: True to use synthetic data without looking for CIFAR-10.
        flops_from: "compiled", "hlo" or "analytic": where the MFU's FLOP count comes from
            (XLA counts need JAX; the analytic count is always reported too).
        measure_peak: on a CPU, measure a matmul's FLOP/s as the MFU's peak.
        peak_tflops: per-device peak TFLOP/s to use instead of the table.
        memory_limit_mb: address-space limit of each child (a real, artificial memory
            ceiling, e.g. to rehearse OOM handling on a CPU).
        timeout_s: kill a configuration after this long ("timeout" row).
        progress: report each configuration on stderr.

    Returns:
        A `BenchReport`; `report.to_markdown()` is what `keras-accel bench` prints.

    Raises:
        BenchInputError: bad arguments, or data that cannot be loaded.

    Example:
        >>> report = run_benchmark("mlp", [64], samples=128, epochs=2, width=0.05,
        ...                        flops_from="hlo", progress=False)  # doctest: +SKIP
        >>> report.results[0].status  # doctest: +SKIP
        'ok'
    """
    reference = model_reference(model)
    sizes = parse_batch_sizes(batch_sizes)
    if backends is None:
        backends = os.environ.get("KERAS_BACKEND") or "jax"
    names = parse_backends(backends)
    if mixed_precision not in (None, *MIXED_PRECISION):
        raise BenchInputError(
            f"Unknown mixed precision. Received: mixed_precision={mixed_precision!r}. Valid "
            f"values: {', '.join(MIXED_PRECISION)}."
        )
    if flops_from not in FLOPS_FROM:
        raise BenchInputError(
            f"Unknown FLOP source. Received: flops_from={flops_from!r}. Valid values: "
            f"{', '.join(FLOPS_FROM)}."
        )
    if devices is not None:
        check_bench_positive_int(devices, "devices")
    if not (isinstance(width, (int, float)) and width > 0):
        raise BenchInputError(f"`width` must be a positive number. Received: width={width!r}")
    _check_strategy(strategy)
    check_sweep(reference, sizes, samples, epochs, synthetic)

    extra_paths = model_paths(model)
    config = {
        "model": reference,
        "batch_sizes": list(sizes),
        "backends": list(names),
        "epochs": epochs,
        "samples": samples,
        "width": width,
        "mixed_precision": mixed_precision,
        "strategy": strategy,
        "devices": devices,
        "data": data,
        "synthetic": synthetic,
        "flops_from": flops_from,
        "memory_limit_mb": memory_limit_mb,
    }
    started = time.perf_counter()
    meta = {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        # Other processes on the same cores slow every figure down: say how busy it was.
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    bar = Progress(len(names) * len(sizes), enabled=progress)
    results: list[BenchResult] = []
    for backend in names:
        installed = backend_installed(backend)
        for batch in sizes:
            spec = RunSpec(
                model=reference,
                backend=backend,
                batch_size=batch,
                samples=samples,
                epochs=epochs,
                width=float(width),
                mixed_precision=mixed_precision,
                strategy=strategy,
                devices=devices,
                data=None if data is None else os.path.abspath(os.fspath(data)),
                synthetic=synthetic,
                flops_from=flops_from,
                measure_peak=measure_peak,
                peak_tflops=peak_tflops,
                memory_limit_mb=memory_limit_mb,
            ).to_dict()
            label = f"{backend} {reference} batch={batch}"
            if not installed:
                record = {"status": isolate.NOT_INSTALLED}
            else:
                bar.start(label)
                record = isolate.run_isolated(
                    spec,
                    timeout_s=timeout_s,
                    memory_limit_mb=memory_limit_mb,
                    extra_paths=extra_paths,
                )
            if record.get("status") == isolate.INPUT_ERROR:
                bar.finish(label, "input error: the sweep stops")
                raise BenchInputError(record.get("error", "the data or model cannot be made"))
            result = BenchResult.from_record(spec, record)
            results.append(result)
            bar.finish(label, _summary(result, record.get("process_seconds", 0.0)))
    share_across_rows(results)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    return BenchReport(config, results, meta)


def _check_strategy(strategy: str) -> None:
    from keras_accel.adapter.strategies import STRATEGIES

    if strategy not in STRATEGIES:
        raise BenchInputError(
            f"Unknown strategy. Received: strategy={strategy!r}. Valid names: "
            f"{', '.join(STRATEGIES)}."
        )


def model_paths(model) -> list[str]:
    """Where a model function's top-level package lives, so the child can import it."""
    module_name = getattr(model, "__module__", None) if callable(model) else None
    if module_name is None and isinstance(model, str) and ":" in model:
        module_name = model.partition(":")[0]
    module = sys.modules.get(module_name or "")
    path = getattr(module, "__file__", None)
    if not path:
        return [os.getcwd()]
    depth = module_name.count(".") + 1
    root = os.path.abspath(path)
    for _ in range(depth):
        root = os.path.dirname(root)
    if os.path.basename(path) == "__init__.py":
        root = os.path.dirname(root)
    return [root]
