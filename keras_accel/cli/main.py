"""`keras-accel` entry point: one sub-command per job, argparse only."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys

from keras_accel.cli.backend import configured_backend


def _version(package: str) -> str:
    """The installed version of `package`, or of its nightly build (`keras-nightly`,
    `keras-hub-nightly`, which install the same modules under another name)."""
    for name in (package, f"{package}-nightly"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def backend_source() -> str:
    """Where Keras took its backend from, in Keras's own order: the KERAS_BACKEND variable,
    else the "backend" key of `keras.json` in the Keras home, else Keras's default."""
    if os.environ.get("KERAS_BACKEND"):
        return "from the KERAS_BACKEND environment variable"
    from keras_accel.utils import keras_internals

    config = os.path.join(keras_internals.keras_home(), "keras.json")
    try:
        with open(os.path.expanduser(config)) as f:
            chosen = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        chosen = None
    if chosen:
        return f"from {config}; set KERAS_BACKEND to override"
    return "Keras's default; set KERAS_BACKEND to choose"


# Keras backend -> the pip package that provides it.
BACKEND_PACKAGES = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}


def import_keras():
    """`import keras`, or a one-line RuntimeError naming the package the chosen backend needs
    and what would work instead (Keras imports its backend's package as it loads)."""
    try:
        import keras
    except ImportError as e:
        backend, source = configured_backend()
        missing = (getattr(e, "name", None) or "").split(".")[0]
        installed = [
            name
            for name, package in BACKEND_PACKAGES.items()
            if name != backend and importlib.util.find_spec(package) is not None
        ]
        instead = (
            f", or set KERAS_BACKEND to an installed backend ({', '.join(installed)})"
            if installed
            else ""
        )
        if missing and missing == BACKEND_PACKAGES.get(backend):
            raise RuntimeError(
                f"the Keras backend {backend!r} ({source}) needs {missing}, which is not "
                f'installed: `pip install -c constraints.txt -e ".[{backend}]"` from the '
                f"keras-accel checkout (the {backend!r} extra){instead}."
            ) from None
        if missing:
            what = f"no module named {missing!r}: `pip install {missing}`"
        else:
            what = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(
            f"Keras cannot be imported with the backend {backend!r} ({source}): {what}{instead}."
        ) from None
    return keras


def env_report(devices: int | None = None) -> str:
    """What `keras-accel env` prints: backend, versions, devices, and what `auto` picks."""
    keras = import_keras()

    from keras_accel import Accelerator

    lines = [
        f"KERAS_BACKEND: {keras.backend.backend()} ({backend_source()})",
        "versions: "
        + ", ".join(
            f"{name} {_version(dist)}"
            for name, dist in [
                ("keras_accel", "keras-accel"),
                ("keras", "keras"),
                ("jax", "jax"),
                ("tensorflow", "tensorflow"),
                ("keras-hub", "keras-hub"),
            ]
        ),
    ]
    acc = Accelerator()
    lines += [
        f"devices: {', '.join(acc.devices)}",
        f"auto strategy: {acc.strategy_name} with {acc.num_replicas} replica(s)",
        f"processes: {acc.num_processes} (this is process {acc.process_index}"
        + (", the chief)" if acc.is_chief else ")"),
        f"accelerator: {acc!r}",
    ]
    return "\n".join(lines)


def _env(args: argparse.Namespace) -> int:
    if args.virtual_devices is not None:
        from keras_accel.utils.devices import configure_virtual_cpu_devices

        configure_virtual_cpu_devices(args.virtual_devices)
    print(env_report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keras-accel",
        description="Run one Keras 3 training script on CPUs, GPUs or TPUs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    env = commands.add_parser("env", help="print backend, versions, devices and the auto strategy")
    env.add_argument(
        "--virtual-devices",
        type=int,
        default=None,
        metavar="N",
        help="split the CPU into N logical devices first (to try data parallelism on a laptop)",
    )
    env.set_defaults(run=_env)
    from keras_accel.benchmark import cli as bench_cli

    bench = commands.add_parser(
        "bench",
        help="time the CIFAR-10 MLP and CNN by batch size and backend, with MFU and OOM rows",
        description="Time a model by batch size (and backend), each configuration in its own "
        "process: seconds per epoch, microseconds per step, compile time, memory, MFU.",
    )
    bench_cli.add_arguments(bench)
    bench.set_defaults(run=bench_cli.run)
    from keras_accel.cli import launch as launch_cli

    launch = commands.add_parser(
        "launch",
        help="run N processes of one script on this host, as a multi-host cluster would",
        description=launch_cli.__doc__.split("\n\n")[1],
    )
    launch_cli.add_arguments(launch)
    launch.set_defaults(run=launch_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command != "launch":
        # TensorFlow's C++ start-up lines, in this process. `launch` imports no framework
        # and sets its children's default itself, where it must still see the user's value.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        return args.run(args)
    except (ValueError, RuntimeError, TypeError) as e:
        print(f"keras-accel {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
