"""`Accelerator.fit` (host-loop fusion on "auto") against plain `model.fit` (Keras's default,
one step per host call): the same model, data and device, side by side in one process.

Cases: a small Dense model at batch 64 (1,024 steps per epoch), the seed MLP at batch 256
and 4,096, and the seed CNN at batch 256 (a subset). Each case builds two identical models;
after one warm-up epoch each (compilation), one epoch of each is timed in turn, `--rounds`
times, so that machine noise hits both alike; the medians are compared. Every backend runs
in its own child process, on one device (host overhead is what fusion removes; add
`--devices 8` to split the CPU).

    python benchmarks/fusion.py --backends jax,tensorflow
    python benchmarks/fusion.py --backends jax,tensorflow --compile-times

Prints a Markdown table (speed-up = plain epoch time / Accelerator epoch time), with a
column for plain `model.fit` compiled with `steps_per_execution=32` (Keras's own fused
path: a host loop of N dispatches on JAX with Keras 3.15, a scan from 3.16; a while loop on
TensorFlow); `--json PATH` also writes the figures. `--compile-times` instead times the
first epoch's compilation of `acc.fit` at N = 1, 8 and 32 (fresh models, the first epoch
minus the second, median of 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (model, batch size, training rows)
CASES = {
    "dense@64": ("dense", 64, 64 * 1024),
    "mlp@256": ("mlp", 256, 256 * 64),
    "mlp@4096": ("mlp", 4096, 4096 * 8),
    "cnn@256": ("cnn", 256, 256 * 16),
}


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_accel

    if args.devices > 1:
        keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np

    from keras_accel import Accelerator
    from keras_accel.models import cnn, compile_seed, mlp

    acc = Accelerator(seed=0)
    kind, batch, rows = CASES[args.case]
    rows = int(rows * args.scale) // batch * batch
    rng = np.random.default_rng(0)
    if kind == "dense":
        x = rng.normal(size=(rows, 32)).astype("float32")
    else:
        x = rng.random((rows, 32, 32, 3), dtype="float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, rows), 10)

    def build():
        with acc.scope():
            if kind == "dense":
                model = keras.Sequential(
                    [
                        keras.Input((32,)),
                        keras.layers.Dense(64, activation="relu"),
                        keras.layers.Dense(10, activation="softmax"),
                    ]
                )
                model.compile("adam", "categorical_crossentropy", metrics=["accuracy"])
            else:
                model = (mlp if kind == "mlp" else cnn)(input_shape=(32, 32, 3), num_classes=10)
                compile_seed(model)
        return model

    if args.compile_times:
        return compile_times(acc, build, x, y, batch, rows)
    plain, keras_fused, fused = build(), build(), build()
    # Keras's own steps_per_execution (3.15 on JAX: a host loop; 3.16: a scan).
    keras_fused.compile(
        optimizer=keras_fused.optimizer,
        loss=keras_fused.loss,
        metrics=["accuracy"],
        steps_per_execution=32,
    )
    if acc.backend == "jax" and acc.distribution is not None:
        keras.distribution.set_distribution(acc.distribution)
    chosen = []

    class Chosen(keras.callbacks.Callback):  # No batch hooks: fusion is not bounded by it.
        def on_train_begin(self, logs=None):
            chosen.append(self.model.steps_per_execution)

    def plain_epoch(model):
        def run():
            with acc.scope():
                model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

        return run

    def fused_epoch():
        acc.fit(
            fused, x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Chosen()]
        )

    runs = {"plain": plain_epoch(plain), "keras_32": plain_epoch(keras_fused), "acc": fused_epoch}
    for run in runs.values():  # Compilation.
        run()
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    p, k, f = (statistics.median(times[name]) for name in runs)
    return {
        "backend": acc.backend,
        "case": args.case,
        "steps": rows // batch,
        "steps_per_execution": chosen[-1],
        "plain_s": p,
        "keras_32_s": k,
        "fused_s": f,
        "speedup": p / f,
        "vs_keras_32": k / f,
    }


def compile_times(acc, build, x, y, batch, rows) -> dict:
    """The first epoch of `acc.fit` (compilation and one epoch) minus a second epoch, for a
    fresh model at each N: the compile time of one group program, side by side."""
    import statistics

    found = {}
    for _ in range(2):
        for n in (1, 8, 32):
            from keras_accel import Accelerator

            model = build()
            fixed = Accelerator(seed=0, steps_per_execution=n)
            epochs = []
            for _ in range(2):
                started = time.perf_counter()
                fixed.fit(model, x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
                epochs.append(time.perf_counter() - started)
            found.setdefault(n, []).append(epochs[0] - epochs[1])
    return {
        "backend": acc.backend,
        "case": "compile",
        "steps": rows // batch,
        **{f"compile_{n}_s": statistics.median(v) for n, v in found.items()},
    }


def _child(backend: str, case: str, argv: list[str]) -> dict:
    row = run_child(os.path.join(HERE, "fusion.py"), backend, [*argv, f"--case={case}"])
    return {"case": case, **row} if "error" in row else row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each case's rows")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--compile-times",
        action="store_true",
        help="instead: first-epoch compile time of acc.fit at N = 1, 8, 32 (dense@64)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    common = [f"--devices={args.devices}", f"--rounds={args.rounds}", f"--scale={args.scale}"]
    if args.compile_times:
        rows = [
            _child(backend, "dense@64", [*common, "--compile-times"])
            for backend in args.backends.split(",")
        ]
        print("| backend | steps/epoch | compile N=1 s | N=8 s | N=32 s |")
        print("|---|---|---|---|---|")
        for row in rows:
            if "error" in row:
                print(f"| {row['backend']} | error: {row['error']} |")
                continue
            print(
                f"| {row['backend']} | {row['steps']} | {row['compile_1_s']:.2f} "
                f"| {row['compile_8_s']:.2f} | {row['compile_32_s']:.2f} |"
            )
    else:
        rows = [
            _child(backend, case, common)
            for backend in args.backends.split(",")
            for case in args.cases.split(",")
        ]
        print(
            "| backend | case | steps/epoch | N (auto) | model.fit s/epoch | model.fit N=32 "
            "s/epoch | acc.fit s/epoch | speed-up vs model.fit | vs model.fit N=32 |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            if "error" in row:
                print(f"| {row['backend']} | {row['case']} | error: {row['error']} |")
                continue
            print(
                f"| {row['backend']} | {row['case']} | {row['steps']} "
                f"| {row['steps_per_execution']} | {row['plain_s']:.3f} | {row['keras_32_s']:.3f} "
                f"| {row['fused_s']:.3f} | {row['speedup']:.2f}x | {row['vs_keras_32']:.2f}x |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
