"""How long deleting an iterator of a `tf.distribute` data set takes on TensorFlow, by kind.

Keras's TF trainer makes a new iterator of its distributed data set every epoch and drops
the last one as the next epoch's first step begins (and `fit`'s at its return). Each
device's data set that TensorFlow's `MultiDeviceIterator` builds for an iterator runs with
tf.data's default options, so with an autotuning thread; once a `tf.function` has read the
iterator, deleting it waits for those threads' next tuning period (which doubles, up to a
minute) instead of stopping them. The Accelerator's distributed data sets build those
data sets without that thread (`keras_accel.adapter.backends.tensorflow.runtime.
Distributed`).

Each kind runs in its own process over `--devices` virtual CPU devices: a MirroredStrategy
(summing through one device, as the Accelerator's), a pipeline of `--rows` rows of 3,072
floats in batches of 256 with an autotuned `map` and `prefetch`, repeated; a `tf.function`
reads a batch on every replica every 50 ms for `--seconds`, then the iterator is deleted and
that is timed.

- `experimental_distribute_dataset`: TensorFlow's, what plain `model.fit` makes;
- `distribute_datasets_from_function`: TensorFlow's, what the Accelerator builds on;
- `accelerator`: the Accelerator's own (`Accelerator._runtime.distribute`).

    python benchmarks/tf_iterator_deletion.py
    python benchmarks/tf_iterator_deletion.py --seconds 30 --kinds accelerator
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _child import run_child

KINDS = ("experimental_distribute_dataset", "distribute_datasets_from_function", "accelerator")


def measure(args) -> dict:
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    import numpy as np
    import tensorflow as tf

    x = np.random.default_rng(0).random((args.rows, 3072), dtype="float32")
    pipeline = tf.data.Dataset.from_tensor_slices(x).batch(256, drop_remainder=True)
    pipeline = pipeline.map(lambda b: b * 2, num_parallel_calls=tf.data.AUTOTUNE)
    pipeline = pipeline.repeat().prefetch(tf.data.AUTOTUNE)
    acc = keras_accel.Accelerator(devices=args.devices)
    strategy = acc.distribution
    if args.kind == "experimental_distribute_dataset":
        distributed = strategy.experimental_distribute_dataset(pipeline)
    elif args.kind == "distribute_datasets_from_function":
        distributed = strategy.distribute_datasets_from_function(lambda context: pipeline)
    else:
        distributed = acc._runtime.distribute(pipeline, 256)

    @tf.function
    def step(iterator):
        return strategy.run(tf.reduce_sum, args=(next(iterator),))

    iterator = iter(distributed)
    started, batches = time.perf_counter(), 0
    while time.perf_counter() - started < args.seconds:
        step(iterator)
        batches += 1
        time.sleep(0.05)
    deleting = time.perf_counter()
    del iterator
    return {
        "kind": args.kind,
        "read_s": args.seconds,
        "batches": batches,
        "delete_s": time.perf_counter() - deleting,
        "load": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long it is read")
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    if args.devices < 2:
        parser.error(f"--devices must be at least 2 (a MirroredStrategy); received {args.devices}")
    if args.rows < 256:
        parser.error(f"--rows must be at least 256 (one batch); received {args.rows}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive; received {args.seconds}")
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    print("| distributed data set | read for s | batches | delete s | load |")
    print("|---|---:|---:|---:|---:|")
    for kind in kinds:
        argv = [
            f"--devices={args.devices}",
            f"--seconds={args.seconds}",
            f"--rows={args.rows}",
            f"--kind={kind}",
        ]
        row = run_child(os.path.abspath(__file__), "tensorflow", argv)
        if "error" in row:
            print(f"| {kind} | error: {row['error']} |")
            continue
        print(
            f"| {kind} | {row['read_s']:.0f} | {row['batches']} | {row['delete_s']:.3f} | "
            f"{row['load']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
