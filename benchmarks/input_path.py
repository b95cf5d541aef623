"""`acc.fit` against plain `model.fit` over in-memory arrays: every seed row, side by side.

For each backend, device count (1, and 8 virtual CPU devices: `DataParallel` on JAX, plain
Keras under the Accelerator's `MirroredStrategy` on TensorFlow), seed model (MLP, CNN) and
batch size (256, 1024, 4096), one child process builds two identical models and fits each
for one epoch in turn (`shuffle=True`, Keras's default), a warm-up round first, then
`--rounds` rounds; an epoch is timed by a callback (its end waits for the step's results).
The ratio is plain epoch time / `acc.fit` epoch time (>= 1: the Accelerator is as fast),
the median of the rounds' ratios with their spread, so that machine noise, which hits both
alike within a round, cancels as far as it can.

On TensorFlow with several replicas a third model is fitted in each round by
`Accelerator(sync_batchnorm=False)`: BatchNormalization statistics per replica, as plain
Keras computes them there, where the default's are the global batch's (two all-reduces per
layer and step, which plain Keras does not pay); "ratio, local BN" is plain / that.

    python benchmarks/input_path.py                      # every row (about 30 min on 2 cores)
    python benchmarks/input_path.py --quick              # MLP only, batch 256 and 1024, 1 round
    python benchmarks/input_path.py --backends tensorflow --devices 1 --models mlp

`--input pydataset` feeds both a `keras.utils.PyDataset` over the same arrays (in order,
`shuffle=False`) instead of the arrays.

`--epochs N` (N > 1) fits N epochs per call and times the whole `fit` call, divided by N:
what a user waits for, epoch boundaries and the return included (on TensorFlow with several
replicas, Keras's trainer makes each epoch's iterator anew and deletes the last one there).

The CNN runs at `--cnn-width` (default 0.25: 1/16 of the seed CNN's FLOPs) so that batch
4096 fits the time on a CPU; `--cnn-width 1` is the seed's. Prints a Markdown table;
`--json PATH` also writes the figures.
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

    if args.devices > 1:
        keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np

    from keras_accel import Accelerator
    from keras_accel.models import cnn, compile_seed, mlp

    acc = Accelerator(seed=0)
    batch = args.batch_size
    rows = batch * args.steps
    rng = np.random.default_rng(0)
    x = rng.random((rows, 32, 32, 3), dtype="float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, rows), 10)

    def build():
        with acc.scope():
            if args.model == "mlp":
                model = mlp(input_shape=(32, 32, 3), num_classes=10)
            else:
                model = cnn(input_shape=(32, 32, 3), num_classes=10, width=args.cnn_width)
            return compile_seed(model)

    # Same devices, so the same tf.distribute strategy: models built in acc's scope suit it.
    local = Accelerator(seed=0, sync_batchnorm=False)
    third = acc.backend == "tensorflow" and acc.num_replicas > 1
    plain, ours = build(), build()
    theirs = build() if third else None
    if acc.backend == "jax" and acc.distribution is not None:
        keras.distribution.set_distribution(acc.distribution)

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    class Batches(keras.utils.PyDataset):  # `--input pydataset`: the same rows, in order.
        def __init__(self):
            super().__init__()

        def __len__(self):
            return args.steps

        def __getitem__(self, index):
            return x[index * batch : (index + 1) * batch], y[index * batch : (index + 1) * batch]

    if args.input == "pydataset":
        inputs, options = (Batches(),), {"shuffle": False}
    else:
        inputs, options = (x, y), {"batch_size": batch}

    def timed(fit, epochs: int) -> float:
        """One epoch's seconds: the epoch's own (one epoch), or the whole call's / epochs."""
        timer = Timer()
        called = time.perf_counter()
        fit(*inputs, **options, epochs=epochs, verbose=0, callbacks=[timer])
        return timer.seconds if epochs == 1 else (time.perf_counter() - called) / epochs

    def plain_epoch(epochs=args.epochs):
        with acc.scope():
            return timed(plain.fit, epochs)

    def acc_epoch(epochs=args.epochs):
        return timed(lambda *a, **k: acc.fit(ours, *a, **k), epochs)

    def local_epoch(epochs=args.epochs):
        return timed(lambda *a, **k: local.fit(theirs, *a, **k), epochs)

    plain_epoch(1), acc_epoch(1)  # Compilation.
    if third:
        local_epoch(1)
    t_plain, t_acc, t_local = [], [], []
    for _ in range(args.rounds):
        t_plain.append(plain_epoch())
        t_acc.append(acc_epoch())
        if third:
            t_local.append(local_epoch())
    ratios = [p / a for p, a in zip(t_plain, t_acc)]
    extra = {}
    if third:
        local_ratios = [p / a for p, a in zip(t_plain, t_local)]
        extra = {
            "local_s": statistics.median(t_local),
            "ratio_local": statistics.median(local_ratios),
            "ratio_local_min": min(local_ratios),
            "ratio_local_max": max(local_ratios),
        }
    return {
        "backend": acc.backend,
        "replicas": acc.num_replicas,
        "model": args.model,
        "batch": batch,
        "steps": args.steps,
        "epochs": args.epochs,
        "input": args.input,
        "plain_s": statistics.median(t_plain),
        "acc_s": statistics.median(t_acc),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "load": os.getloadavg()[0],
        **extra,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--devices", default="1,8", help="device counts, comma-separated")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--batch-sizes", default="256,1024,4096")
    parser.add_argument("--steps", type=int, default=4, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--epochs", type=int, default=1, help="epochs per fit (> 1: the whole call is timed)"
    )
    parser.add_argument(
        "--input",
        choices=("arrays", "pydataset"),
        default="arrays",
        help="arrays (fit's x, y, batch_size) or a keras.utils.PyDataset over them",
    )
    parser.add_argument("--cnn-width", type=float, default=0.25)
    parser.add_argument("--quick", action="store_true", help="MLP, batch 256 and 1024, 1 round")
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1; received {args.epochs}")
    if args.child:
        args.devices = int(args.devices)
        print(json.dumps(measure(args)))
        return 0
    if args.quick:
        args.models, args.batch_sizes, args.rounds, args.steps = "mlp", "256,1024", 1, 2
    rows = []
    started = time.perf_counter()
    for backend in args.backends.split(","):
        for devices in args.devices.split(","):
            for model in args.models.split(","):
                for batch in args.batch_sizes.split(","):
                    argv = [
                        f"--devices={devices}",
                        f"--model={model}",
                        f"--batch-size={batch}",
                        f"--steps={args.steps}",
                        f"--rounds={args.rounds}",
                        f"--epochs={args.epochs}",
                        f"--input={args.input}",
                        f"--cnn-width={args.cnn_width}",
                    ]
                    row = run_child(os.path.join(HERE, "input_path.py"), backend, argv)
                    row.setdefault("model", model)
                    row.setdefault("batch", int(batch))
                    row.setdefault("replicas", int(devices))
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        "| backend | devices | model | batch | model.fit s/epoch | acc.fit s/epoch | "
        "ratio (median) | ratio spread | ratio, local BN | its spread | load |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|---:|---|---:|")
    for r in rows:
        if "error" in r:
            print(
                f"| {r['backend']} | {r['replicas']} | {r['model']} | {r['batch']} | "
                f"error: {r['error']} |"
            )
            continue
        local = " | "
        if "ratio_local" in r:
            spread = f"{r['ratio_local_min']:.2f}-{r['ratio_local_max']:.2f}"
            local = f"{r['ratio_local']:.2f} | {spread}"
        print(
            f"| {r['backend']} | {r['replicas']} | {r['model']} | {r['batch']} | "
            f"{r['plain_s']:.2f} | {r['acc_s']:.2f} | {r['ratio']:.2f} | "
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f} | {local} | {r['load']:.1f} |"
        )
    print(
        f"\n{args.input}, {args.steps} steps per epoch, {args.epochs} epoch(s) per fit, "
        f"{args.rounds} rounds, "
        f"{time.perf_counter() - started:.0f} s in all."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
