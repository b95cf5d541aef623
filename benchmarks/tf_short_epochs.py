"""What a fit of many short epochs costs over TensorFlow's 8 CPU replicas, per epoch, and how
many per-device iterators it makes.

Keras's TF epoch iterator asks its distributed data set for an iterator at each epoch's
start and again at its end (for the next epoch, which asks anew when `steps_per_epoch` is
not given, so drops that one unread), and so does each validation pass. Over 8 replicas
making one costs about half a second (TensorFlow traces each device's reader functions for
it); the Accelerator's distributed data sets make an iterator when it is first read
(`keras_accel.adapter.backends.tensorflow.runtime.Distributed`).

One process: a `Dense` model on `--rows` rows of 8 features, `--epochs` epochs of batch
`--batch-size` with a quarter of the rows held out for validation, `acc.fit` then plain
`model.fit` under the same `MirroredStrategy`, each after a warm-up fit of one epoch (its
tracing), each `--rounds` times, alternating. Reported: seconds per epoch (median), and
the per-device iterators each fit made (TensorFlow's `OwnedMultiDeviceIterator`s made,
counted by wrapping its `__init__`). Plain `model.fit` also waits at epoch boundaries for
tf.data's autotuning threads (the section "the epoch boundary" of docs/benchmarks.md).

    python benchmarks/tf_short_epochs.py
    python benchmarks/tf_short_epochs.py --fits acc.fit --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _child import run_child

FITS = ("acc.fit", "model.fit")


def measure(args) -> dict:
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops

    made = [0]
    init = ops.OwnedMultiDeviceIterator.__init__

    def counted(self, *a, **kw):  # Made, not rebuilt inside a traced step.
        made[0] += kw.get("components") is None
        init(self, *a, **kw)

    ops.OwnedMultiDeviceIterator.__init__ = counted
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 8)).astype("float32")
    y = rng.normal(size=(args.rows, 4)).astype("float32")
    acc = keras_accel.Accelerator(devices=args.devices, seed=0)
    with acc.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile("adam", "mse")
    fits = {
        "acc.fit": lambda epochs: acc.fit(
            model, x, y, batch_size=args.batch_size, epochs=epochs, verbose=0,
            validation_split=0.25,
        ),
        "model.fit": lambda epochs: model.fit(
            x, y, batch_size=args.batch_size, epochs=epochs, verbose=0, validation_split=0.25
        ),
    }  # fmt: skip
    fits = {name: fits[name] for name in args.fits.split(",")}
    seconds = {name: [] for name in fits}
    iterators = {}
    for fit in fits.values():
        fit(1)  # Traced here, not in the rounds.
    for _ in range(args.rounds):
        for name, fit in fits.items():
            made[0] = 0
            began = time.perf_counter()
            fit(args.epochs)
            seconds[name].append((time.perf_counter() - began) / args.epochs)
            iterators[name] = made[0]
    return {
        name: {"s_per_epoch": statistics.median(s), "iterators": iterators[name]}
        for name, s in seconds.items()
    } | {"load": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=11)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fits", default=",".join(FITS), help="which of " + ", ".join(FITS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.fits.split(",")) - set(FITS))
    if unknown:
        parser.error(f"unknown fits {unknown}; choose from {', '.join(FITS)}")
    if args.devices < 2:
        parser.error(f"--devices must be at least 2 (a MirroredStrategy); received {args.devices}")
    for name in ("epochs", "rows", "batch_size", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive; received "
                         f"{getattr(args, name)}")  # fmt: skip
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}"
            for name in ("devices", "epochs", "rows", "batch_size", "rounds", "fits")]  # fmt: skip
    row = run_child(os.path.abspath(__file__), "tensorflow", argv)
    if "error" in row:
        print(f"error: {row['error']}")
        return 1
    print(f"| {args.devices} replicas, {args.epochs} epochs | s/epoch | iterators made per fit |")
    print("|---|---:|---:|")
    for name in args.fits.split(","):
        print(f"| {name} | {row[name]['s_per_epoch']:.3f} | {row[name]['iterators']} |")
    print(f"(load {row['load']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
