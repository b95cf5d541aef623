"""The `keras-accel bench` sub-command: arguments, `--quick` defaults, and the output files."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from keras_accel.benchmark.finder import find_batch_size
from keras_accel.benchmark.isolate import ERROR, TIMEOUT
from keras_accel.benchmark.results import import_pyplot
from keras_accel.benchmark.spec import (
    CIFAR10_TRAIN,
    FLOPS_FROM,
    MIXED_PRECISION,
    MODELS,
    SEED_BATCH_SIZES,
    BenchInputError,
    backend_installed,
    model_reference,
    parse_backends,
    parse_batch_sizes,
)
from keras_accel.benchmark.sweep import run_benchmark
from keras_accel.state import outputs

# Without --quick: the seed's sweep, on the active backend.
FULL_DEFAULTS = {
    "model": "mlp",
    "batch_sizes": SEED_BATCH_SIZES,
    "epochs": 3,
    "samples": CIFAR10_TRAIN,
    "backends": None,  # $KERAS_BACKEND, else jax
    "flops_from": "compiled",
    "timeout": 3600.0,
}
# --quick: a laptop or CI check that the whole pipeline works on both backends in well under
# 3 minutes on 2 CPU cores (~20 s per configuration, most of it start-up and compilation).
QUICK_DEFAULTS = {
    "model": "mlp",
    "batch_sizes": (256, 1024),
    "epochs": 3,
    "samples": 2048,
    "backends": ("jax", "tensorflow"),
    "flops_from": "hlo",
    "timeout": 300.0,
}


def _type(parse):
    """An argparse `type=` that turns our input errors into argparse's usage errors."""

    def convert(text: str):
        try:
            return parse(text)
        except BenchInputError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


def _positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer. Received: {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number. Received: {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `bench` options to `parser` (the sub-parser of `keras-accel`)."""
    models = ", ".join(MODELS)
    add = parser.add_argument
    add(
        "--model",
        type=_type(model_reference),
        default=None,
        help=f"{models}, or package.module:function returning a Keras model (default: mlp)",
    )
    add(
        "--batch-sizes",
        type=_type(parse_batch_sizes),
        default=None,
        metavar="B1,B2,...",
        help="global batch sizes (default: the CIFAR-10 write-up's 256,1024,4096,8192,16384,50000)",
    )
    add(
        "--epochs",
        type=_positive_int,
        default=None,
        help="epochs per configuration; the first compiles, the best of the rest is reported "
        "(default: 3)",
    )
    add(
        "--samples",
        type=_positive_int,
        default=None,
        help=f"training samples per epoch (default: {CIFAR10_TRAIN}, all of CIFAR-10)",
    )
    add(
        "--width",
        type=_positive_float,
        default=1.0,
        help="width multiplier of the CIFAR-10 MLP/CNN (default: 1.0, the write-up's model)",
    )
    add(
        "--mixed-precision",
        choices=MIXED_PRECISION,
        default=None,
        help="compute dtype policy (default: float32)",
    )
    add("--strategy", default="auto", help="Accelerator strategy (default: auto)")
    add(
        "--devices",
        type=_positive_int,
        default=None,
        help="devices per configuration; on a CPU, that many virtual devices (default: 1 CPU "
        "device, or every accelerator)",
    )
    add(
        "--backends",
        type=_type(parse_backends),
        default=None,
        metavar="B1,B2",
        help="Keras backends side by side, each in its own processes (default: "
        "$KERAS_BACKEND; with --quick: jax,tensorflow)",
    )
    add(
        "--data",
        default=None,
        metavar="PATH",
        help="CIFAR-10 archive or directory (default: Keras's caches, else synthetic data)",
    )
    add("--synthetic", action="store_true", help="use synthetic data without looking for CIFAR-10")
    add(
        "--json",
        default=None,
        metavar="FILE",
        help="write every figure as JSON (a path or a URL: gs://, s3://, any fsspec protocol)",
    )
    add(
        "--csv",
        default=None,
        metavar="FILE",
        help="write one CSV row per configuration (a path or a URL)",
    )
    add(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="plot s/epoch and MFU against batch size (a path or a URL; needs matplotlib)",
    )
    add(
        "--quick",
        action="store_true",
        help="a small sweep for a laptop or CI: mlp, 2048 samples, batch sizes 256,1024, both "
        "backends; options given explicitly still apply",
    )
    add(
        "--flops-from",
        choices=FLOPS_FROM,
        default=None,
        help="FLOP count for MFU: XLA cost analysis of the compiled step, of the unoptimized "
        "program (hlo, no extra compile), or analytic (default: compiled; --quick: hlo)",
    )
    add(
        "--peak-tflops",
        type=_positive_float,
        default=None,
        help="peak TFLOP/s per device, instead of the device table or the CPU measurement",
    )
    add(
        "--memory-limit-mb",
        type=_positive_int,
        default=None,
        help="address-space limit of each child process, to rehearse OOM handling on a CPU "
        "(not on GPUs: CUDA reserves far more address space than it uses)",
    )
    add(
        "--timeout",
        type=_positive_float,
        default=None,
        help="seconds before a configuration is killed (default: 3600; --quick: 300)",
    )
    add("--no-progress", action="store_true", help="do not report progress on stderr")
    finder = parser.add_argument_group("batch-size finder (--find-batch-size)")
    finder.add_argument(
        "--find-batch-size",
        action="store_true",
        help="find the largest batch that trains without OOM, per backend",
    )
    finder.add_argument(
        "--start", type=_positive_int, default=64, help="first batch size tried (default: 64)"
    )
    finder.add_argument(
        "--max-batch-size",
        type=_positive_int,
        default=65536,
        help="largest batch size tried (default: 65536)",
    )
    finder.add_argument(
        "--margin",
        type=float,
        default=0.1,
        help="safety margin below the limit (default: 0.1, i.e. 90%%)",
    )
    finder.add_argument(
        "--multiple-of",
        type=_positive_int,
        default=8,
        help="granularity of the batch sizes (default: 8)",
    )


def resolve(args: argparse.Namespace) -> dict:
    """The sweep's settings: what was given, else the --quick or full defaults."""
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    return {
        key: getattr(args, key) if getattr(args, key) is not None else default
        for key, default in defaults.items()
    }


def run(args: argparse.Namespace) -> int:
    """Run `keras-accel bench`; returns the exit status (1 if a configuration errored or an
    output could not be written)."""
    settings = resolve(args)
    if args.find_batch_size and (args.csv or args.plot):
        raise BenchInputError(
            "--find-batch-size writes its result with --json only; --csv and --plot belong to "
            f"the sweep. Received: --csv {args.csv!r}, --plot {args.plot!r}"
        )
    if args.plot:
        try:
            import_pyplot()  # fail now, not after an hour of measurements
        except ImportError as error:
            raise BenchInputError(str(error)) from None
    _check_outputs(args)
    if args.find_batch_size:
        return _find(args, settings)
    report = run_benchmark(
        settings["model"],
        settings["batch_sizes"],
        backends=settings["backends"],
        epochs=settings["epochs"],
        samples=settings["samples"],
        width=args.width,
        mixed_precision=args.mixed_precision,
        strategy=args.strategy,
        devices=args.devices,
        data=args.data,
        synthetic=True if args.synthetic else None,
        flops_from=settings["flops_from"],
        peak_tflops=args.peak_tflops,
        memory_limit_mb=args.memory_limit_mb,
        timeout_s=settings["timeout"],
        progress=not args.no_progress,
    )
    report.meta["command"] = "keras-accel bench " + " ".join(sys.argv[2:])
    print(report.to_markdown())
    written = _write_outputs(
        [
            ("json", args.json, report.to_json),
            ("csv", args.csv, report.to_csv),
            ("plot", args.plot, report.plot),
        ]
    )
    failed = [r for r in report.results if r.status in (ERROR, TIMEOUT)]
    return 1 if failed or not written else 0


OUTPUTS = ("json", "csv", "plot")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every --json/--csv/--plot target checked before the sweep, not after it."""
    for option in OUTPUTS:
        path = getattr(args, option, None)
        if path is None:
            continue
        try:
            outputs.check_writable(path)
        except Exception as error:  # Whatever the store says (credentials too), said now.
            raise BenchInputError(
                f"--{option} {path!r} cannot be written: {type(error).__name__}: {error}"
            ) from None


def _write_outputs(targets: list[tuple[str, str | None, Callable[[str], None]]]) -> bool:
    """Write each requested `(option, path, writer)`. One that fails (a store refusing the
    upload after the sweep) is reported on stderr and the others are still written, since
    the measurements cost far more than a retry. True if every one was written."""
    written = True
    for option, path, writer in targets:
        if path is None:
            continue
        try:
            writer(path)
        except Exception as error:  # Any store error: the other outputs still go out.
            written = False
            print(
                f"keras-accel bench: error: --{option} {path!r} was not written: "
                f"{type(error).__name__}: {error}. The table above holds the figures.",
                file=sys.stderr,
            )
    return written


def _find(args: argparse.Namespace, settings: dict) -> int:
    backends = settings["backends"] or [None]
    found = []
    lines = [
        "| backend | batch size | samples/s | largest that trained | first OOM | tries |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for backend in backends:
        if backend is not None and not backend_installed(backend):
            lines.append(f"| {backend} | not installed | | | | |")
            continue
        result = find_batch_size(
            settings["model"],
            backend=backend,
            start=args.start,
            max_batch_size=args.max_batch_size,
            margin=args.margin,
            multiple_of=args.multiple_of,
            width=args.width,
            mixed_precision=args.mixed_precision,
            strategy=args.strategy,
            devices=args.devices,
            memory_limit_mb=args.memory_limit_mb,
            timeout_s=settings["timeout"],
            progress=not args.no_progress,
        )
        found.append(result)
        speed = "n/a" if result.samples_per_second is None else f"{result.samples_per_second:,.0f}"
        lines.append(
            f"| {result.backend} | {result.batch_size} | {speed} | {result.max_batch_size} | "
            f"{result.first_oom or 'none'} | {len(result.tries)} |"
        )
    print(
        f"## keras-accel bench --find-batch-size: {settings['model']} (margin {args.margin:.0%})\n"
    )
    print("\n".join(lines))
    text = json.dumps([r.to_dict() for r in found], indent=2)
    written = _write_outputs([("json", args.json, lambda path: outputs.write(path, text))])
    return 0 if written else 1
