"""Overhead of `Accelerator.fit` against plain `model.fit`: speed ratio and peak host memory.

Both run the same model under the same distribution on divisible data (so plain Keras works),
side by side in one process, alternating epochs so that machine noise hits both alike. Peak
memory is measured in two child processes (peak RSS only grows), on a CIFAR-10-sized array.

    python benchmarks/accelerator_overhead.py --backends jax,tensorflow

Prints a Markdown table; `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))


def _setup(devices: int):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(devices)


def _model(acc, inputs: int):
    import keras

    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((inputs,)),
                keras.layers.Dense(512),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"]
        )
    return model


class _EpochTimer:
    def __init__(self):
        import keras

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(inner, epoch, logs=None):  # noqa: N805
                inner.start = time.perf_counter()

            def on_epoch_end(inner, epoch, logs=None):  # noqa: N805
                self.times.append(time.perf_counter() - inner.start)

        self.times: list[float] = []
        self.callback = Timer()


def speed(args) -> dict:
    """Median seconds per epoch of each, after one warm-up epoch each, alternating."""
    _setup(args.devices)
    import keras
    import numpy as np

    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, args.features), dtype="float32")
    y = rng.integers(0, 10, args.samples)
    ours, plain = _model(acc, args.features), _model(acc, args.features)
    t_ours, t_plain = _EpochTimer(), _EpochTimer()
    if acc.backend == "jax" and acc.distribution is not None:
        keras.distribution.set_distribution(acc.distribution)
    for _ in range(args.rounds + 1):
        acc.fit(
            ours, x, y, batch_size=args.batch_size, epochs=1, verbose=0, callbacks=[t_ours.callback]
        )
        with acc.scope():
            plain.fit(
                x, y, batch_size=args.batch_size, epochs=1, verbose=0, callbacks=[t_plain.callback]
            )
    steps = args.samples // args.batch_size
    ours_s, plain_s = statistics.median(t_ours.times[1:]), statistics.median(t_plain.times[1:])
    return {
        "backend": acc.backend,
        "replicas": acc.num_replicas,
        "steps_per_epoch": steps,
        "acc_fit_steps_per_s": steps / ours_s,
        "model_fit_steps_per_s": steps / plain_s,
        "ratio": plain_s / ours_s,
    }


def memory(args) -> dict:
    """Peak RSS above the data set's own footprint for one epoch of `which` fit."""
    _setup(args.devices)
    import numpy as np

    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    model = _model(acc, args.mem_features)
    rng = np.random.default_rng(0)
    x = rng.random((args.mem_samples, args.mem_features), dtype="float32")
    y = rng.integers(0, 10, args.mem_samples)
    # Warm up on a slice, so compilation and runtime start-up are in the baseline.
    acc.fit(model, x[:4096], y[:4096], batch_size=args.batch_size, epochs=1, verbose=0)
    if args.which == "plain":
        import keras

        if acc.backend == "jax" and acc.distribution is not None:
            keras.distribution.set_distribution(acc.distribution)
        with acc.scope():
            model.fit(x[:4096], y[:4096], batch_size=args.batch_size, epochs=1, verbose=0)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.which == "plain":
        with acc.scope():
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)
    else:
        acc.fit(model, x, y, batch_size=args.batch_size, epochs=1, verbose=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "which": args.which,
        "peak_bytes": peak,
        "growth_bytes": peak - baseline,
        "data_bytes": x.nbytes,
        "batch_bytes": x.nbytes * args.batch_size // len(x),
    }


def _child(backend: str, argv: list[str]) -> dict:
    return run_child(os.path.join(HERE, "accelerator_overhead.py"), backend, argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--features", type=int, default=3072)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mem-samples", type=int, default=50000)
    parser.add_argument("--mem-features", type=int, default=3072)
    parser.add_argument("--json", default=None)
    parser.add_argument("--mode", choices=["speed", "memory"], default=None)
    parser.add_argument(
        "--modes", default="speed,memory", help="what to measure: speed, memory or both"
    )
    parser.add_argument("--which", choices=["acc", "plain"], default="acc")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(speed(args) if args.mode == "speed" else memory(args)))
        return 0
    common = [
        f"--devices={args.devices}",
        f"--samples={args.samples}",
        f"--features={args.features}",
        f"--batch-size={args.batch_size}",
        f"--rounds={args.rounds}",
        f"--mem-samples={args.mem_samples}",
        f"--mem-features={args.mem_features}",
    ]
    rows = []
    for backend in args.backends.split(","):
        modes = args.modes.split(",")
        row = {"backend": backend, "speed": {}, "plain": {}, "acc": {}}
        if "speed" in modes:
            row["speed"] = _child(backend, [*common, "--mode=speed"])
        if "memory" in modes:
            for which in ("plain", "acc"):
                row[which] = _child(backend, [*common, "--mode=memory", f"--which={which}"])
        rows.append(row)
    mib = 2**20
    print(
        "| backend | replicas | model.fit steps/s | acc.fit steps/s | ratio | "
        "model.fit peak growth MiB | acc.fit peak growth MiB | global batch MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        s, p, a = row["speed"], row["plain"], row["acc"]
        if "error" in s or "error" in p or "error" in a:
            error = s.get("error") or p.get("error") or a.get("error")
            print(f"| {row['backend']} | error: {error} |")
            continue
        speed_cells = (
            f"{s['replicas']} | {s['model_fit_steps_per_s']:.2f} | "
            f"{s['acc_fit_steps_per_s']:.2f} | {s['ratio']:.3f}"
            if s
            else f"{args.devices} | - | - | -"
        )
        memory_cells = (
            f"{p['growth_bytes'] / mib:.0f} | {a['growth_bytes'] / mib:.0f} | "
            f"{a['batch_bytes'] / mib:.0f}"
            if a
            else "- | - | -"
        )
        print(f"| {row['backend']} | {speed_cells} | {memory_cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
