"""What one Accelerator keeps of the models it ran: a notebook or a hyperparameter search
that makes a new model for each fit, through one Accelerator, and drops the last one.

A compiled step closes over its model, and the Accelerator keeps its compiled steps between
calls (a second `acc.fit` compiles nothing): kept for every model, every model stays alive
with its weights and traced graphs. Under TensorFlow's strategies a sum taken with
`ReplicaContext.all_reduce` in a traced step also registers a gradient function in
TensorFlow's global registry, which holds the step's graphs for the process's life.

One process per backend: `--models` new models (Dense 64-256-256-10, Adam), each `acc.fit`
for one epoch with validation, `acc.evaluate` and `acc.predict`, then dropped. Reported after
the last one is dropped and `gc.collect()`: the models still alive (of those run), the
process's resident memory added from the second model's end to the last's, and, on
TensorFlow, the traced graphs (`FuncGraph`s) alive and the entries added to the gradient
registry (from the second model on: the first one's include TensorFlow's own, once a
process).

    python benchmarks/models_kept.py
    python benchmarks/models_kept.py --backends tensorflow --models 12
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from _child import run_child

BACKENDS = ("jax", "tensorflow", "torch")


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(args) -> dict:
    import gc
    import weakref

    import keras_accel

    backend = os.environ["KERAS_BACKEND"]
    if backend != "torch":
        keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np

    graphs = registry = None
    if backend == "tensorflow":
        from tensorflow.python.framework import func_graph, ops

        def graphs():
            return sum(isinstance(o, func_graph.FuncGraph) for o in gc.get_objects())

        def registry():
            return len(ops.gradient_registry._registry)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 64)).astype("float32")
    y = rng.integers(0, 10, args.rows)
    acc = keras_accel.Accelerator(seed=0, devices=None if backend == "torch" else args.devices)
    models, start = [], {}
    for i in range(args.models):
        with acc.scope():
            model = keras.Sequential([
                keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10),
            ])  # fmt: skip
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])  # fmt: skip
        acc.fit(model, x, y, batch_size=32, epochs=1, validation_split=0.25, verbose=0)
        acc.evaluate(model, x, y, batch_size=32, verbose=0)
        acc.predict(model, x, batch_size=32, verbose=0)
        models.append(weakref.ref(model))
        del model
        gc.collect()
        if i == 1:
            start = {"mb": _resident_mb(), "registry": registry() if registry else None}
    row = {
        "backend": backend,
        "models": args.models,
        "alive": sum(ref() is not None for ref in models),
        "mb_added": _resident_mb() - start["mb"],
    }
    if graphs is not None:
        row["graphs"] = graphs()
        row["registered"] = registry() - start["registry"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--devices", type=int, default=8, help="JAX's and TensorFlow's")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.backends.split(",")) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    if args.models < 3:
        parser.error(f"--models must be at least 3 (counted from the second); received "
                     f"{args.models}")  # fmt: skip
    for name in ("devices", "rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive; received {getattr(args, name)}")
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    argv = [f"--{name}={getattr(args, name)}" for name in ("models", "devices", "rows")]
    print("| backend | models run | alive after the last is dropped | MB added (2nd to last) "
          "| TF graphs alive | TF gradient functions registered |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    status = 0
    for backend in args.backends.split(","):
        row = run_child(os.path.abspath(__file__), backend, argv)
        if "error" in row:
            print(f"| {backend} | error: {row['error']} |")
            status = 1
            continue
        print(f"| {backend} | {row['models']} | {row['alive']} | {row['mb_added']:.0f} "
              f"| {row.get('graphs', '-')} | {row.get('registered', '-')} |")  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
