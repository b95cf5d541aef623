"""Steps per second of `Accelerator.loop` against `model.fit`: same model, same devices.

Both train the same model (Dense 3072 -> 512, BatchNorm, ReLU, Dense 256, Dense 10; Adam)
under the same distribution (8 virtual CPU devices by default) on divisible data, side by
side in one process, one epoch of each in turn so that machine noise hits both alike; the
median epoch after one warm-up epoch each is compared. Every backend runs in its own child
process.

    python benchmarks/custom_loop_overhead.py --backends jax,tensorflow

Prints a Markdown table; `--json PATH` also writes the figures.
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


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np

    from keras_accel import Accelerator

    acc = Accelerator(seed=0)

    def build():
        with acc.scope():
            model = keras.Sequential(
                [
                    keras.Input((args.features,)),
                    keras.layers.Dense(512),
                    keras.layers.BatchNormalization(),
                    keras.layers.ReLU(),
                    keras.layers.Dense(256, activation="relu"),
                    keras.layers.Dense(10, activation="softmax"),
                ]
            )
            model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    rng = np.random.default_rng(0)
    x = rng.random((args.samples, args.features), dtype="float32")
    y = rng.integers(0, 10, args.samples)
    fitted, looped = build(), build()
    loop = acc.loop(looped, metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")])
    if acc.backend == "jax" and acc.distribution is not None:
        keras.distribution.set_distribution(acc.distribution)
    t_fit, t_loop = [], []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                t_fit.append(time.perf_counter() - self.started)

    for epoch in range(args.rounds + 1):
        with acc.scope():
            fitted.fit(
                x, y, batch_size=args.batch_size, epochs=2, shuffle=False, verbose=0,
                callbacks=[Timer()],
            )  # fmt: skip
        started = time.perf_counter()
        loop.reset_metrics()
        for batch in loop.batches(x, y, batch_size=args.batch_size, epoch=epoch):
            loop.train_step(batch)
        loop.results()  # The epoch's numbers on the host: the device is done.
        t_loop.append(time.perf_counter() - started)
    steps = args.samples // args.batch_size
    fit_s, loop_s = statistics.median(t_fit[1:]), statistics.median(t_loop[1:])
    return {
        "backend": acc.backend,
        "replicas": acc.num_replicas,
        "steps_per_epoch": steps,
        "fit_steps_per_s": steps / fit_s,
        "loop_steps_per_s": steps / loop_s,
        "ratio": fit_s / loop_s,
    }


def _child(backend: str, argv: list[str]) -> dict:
    return run_child(os.path.join(HERE, "custom_loop_overhead.py"), backend, argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--features", type=int, default=3072)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    common = [
        f"--devices={args.devices}",
        f"--samples={args.samples}",
        f"--features={args.features}",
        f"--batch-size={args.batch_size}",
        f"--rounds={args.rounds}",
    ]
    rows = [_child(backend, common) for backend in args.backends.split(",")]
    print("| backend | replicas | model.fit steps/s | acc.loop steps/s | ratio (loop / fit) |")
    print("|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | error: {row['error']} |")
            continue
        print(
            f"| {row['backend']} | {row['replicas']} | {row['fit_steps_per_s']:.2f} | "
            f"{row['loop_steps_per_s']:.2f} | {row['ratio']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
