"""`Accelerator.fit` (host-loop fusion on "auto") against plain `model.fit` (Keras's default,
one step per host call): the same model, data and device, side by side in one process.

Cases: a small Dense model at batch 64 (1,024 steps per epoch), the seed MLP at batch 256
and 4,096, and the seed CNN at batch 256 (a subset). Each case builds two identical models;
after one warm-up epoch each (compilation), one epoch of each is timed in turn, `--rounds`
times, so that machine noise hits both alike; the medians are compared. Every backend runs
in its own child process, on one device (host overhead is what fusion removes; add
`--devices 8` to split the CPU).

    python benchmarks/fusion.py --backends jax,tensorflow

Prints a Markdown table (speed-up = plain epoch time / Accelerator epoch time); `--json
PATH` also writes the figures.
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

    plain, fused = build(), build()
    if acc.backend == "jax" and acc.distribution is not None:
        keras.distribution.set_distribution(acc.distribution)

    def plain_epoch():
        with acc.scope():
            plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    def fused_epoch():
        acc.fit(fused, x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    plain_epoch(), fused_epoch()  # Compilation.
    t_plain, t_fused = [], []
    for _ in range(args.rounds):
        for run, times in ((plain_epoch, t_plain), (fused_epoch, t_fused)):
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
    from keras_accel.callbacks._run import run_state

    p, f = statistics.median(t_plain), statistics.median(t_fused)
    return {
        "backend": acc.backend,
        "case": args.case,
        "steps": rows // batch,
        "steps_per_execution": run_state(fused).steps_per_execution,
        "plain_s": p,
        "fused_s": f,
        "speedup": p / f,
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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    common = [f"--devices={args.devices}", f"--rounds={args.rounds}", f"--scale={args.scale}"]
    rows = [
        _child(backend, case, common)
        for backend in args.backends.split(",")
        for case in args.cases.split(",")
    ]
    print(
        "| backend | case | steps/epoch | N (auto) | model.fit s/epoch | acc.fit s/epoch "
        "| speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | {row['case']} | error: {row['error']} |")
            continue
        print(
            f"| {row['backend']} | {row['case']} | {row['steps']} | {row['steps_per_execution']} "
            f"| {row['plain_s']:.3f} | {row['fused_s']:.3f} | {row['speedup']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
