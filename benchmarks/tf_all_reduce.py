"""What one all-reduce costs on TensorFlow's CPU replicas, by implementation and size.

A step of `acc.fit` on several replicas all-reduces more often than plain Keras's: each
BatchNormalization layer's batch sums forward and backward (the exact global statistics),
the real-row count, the metrics' global results, besides the gradients. On CPU devices
(virtual ones, `keras_accel.configure_virtual_cpu_devices`) TensorFlow's default
`MirroredStrategy` all-reduces with collective ops; this measures that against
`tf.distribute.ReductionToOneDevice` (copies into one device, one AddN, copies back), the
one the Accelerator's strategy uses when every device is a CPU
(`keras_accel.adapter.backends.tensorflow.strategies.cross_device_ops`).

Each (implementation, size) runs in its own process (two default MirroredStrategies over
the same devices in one process share collective keys), in a compiled step whose replicas
chain `--chain` all-reduces of one float32 tensor, one after the other as a network's
BatchNormalization layers do; the figure is (time of that step - time of the same step
with none) / chain, the fastest of `--rounds` rounds of `--calls` calls.

    python benchmarks/tf_all_reduce.py
    python benchmarks/tf_all_reduce.py --devices 4 --sizes 3,1600000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _child import run_child

IMPLEMENTATIONS = ("collective", "one_device")


def measure(args) -> dict:
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    import tensorflow as tf

    devices = [f"/device:CPU:{i}" for i in range(args.devices)]
    ops = tf.distribute.ReductionToOneDevice() if args.implementation == "one_device" else None
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    x = tf.ones((args.size,))

    def step_of(chain):
        @tf.function
        def step():
            def replica():
                context = tf.distribute.get_replica_context()
                value = x
                for _ in range(chain):
                    (total,) = context.all_reduce("SUM", [value])
                    value = value * 0.5 + total * 1e-6  # The next one waits for this one.
                return tf.reduce_sum(value)

            return strategy.run(replica)

        return step

    def fastest(step) -> float:
        step()  # Compilation.
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            best = min(best, (time.perf_counter() - start) / args.calls)
        return best

    base = fastest(step_of(0))
    chained = fastest(step_of(args.chain))
    return {
        "implementation": args.implementation,
        "devices": args.devices,
        "size": args.size,
        "ms": (chained - base) / args.chain * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--sizes", default="3,512,65536,1600000", help="floats per tensor")
    parser.add_argument("--chain", type=int, default=8, help="all-reduces per step")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--implementation", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes takes integers, e.g. 3,512. Received: --sizes {args.sizes}")
    if args.devices < 2 or min(sizes) < 1 or args.chain < 1:
        parser.error(
            f"needs --devices >= 2, sizes >= 1 and --chain >= 1. Received: "
            f"--devices {args.devices}, --sizes {args.sizes}, --chain {args.chain}"
        )
    print(f"{args.devices} CPU replicas, ms per all-reduce:")
    print("| floats | collective | one_device | collective / one_device |")
    print("|---:|---:|---:|---:|")
    shared = ("devices", "chain", "calls", "rounds")
    argv = [f"--{k}={v}" for k, v in vars(args).items() if k in shared]
    failed = False
    for size in sizes:
        row = {}
        for implementation in IMPLEMENTATIONS:
            own = [f"--implementation={implementation}", f"--size={size}"]
            result = run_child(__file__, "tensorflow", [*argv, *own])
            if "error" in result:
                error = result["error"]
                print(f"{implementation} at {size} floats failed: {error}", file=sys.stderr)
                failed = True
                continue
            row[implementation] = result["ms"]
        if len(row) == 2:
            ratio = row["collective"] / row["one_device"]
            print(f"| {size:,} | {row['collective']:.3f} | {row['one_device']:.3f} | {ratio:.1f} |")
    print(f"load {os.getloadavg()[0]:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
