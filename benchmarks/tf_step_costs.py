"""Where `acc.fit`'s time goes on TensorFlow with 8 replicas: plain `model.fit`, `acc.fit`, and
`acc.fit` with one of its per-step costs taken out at a time, side by side in one process.

A diagnostic: but for `local_bn` (the public `Accelerator(sync_batchnorm=False)`) and
`plain_synchronized`, each variant replaces one piece of keras_accel for its own model (the
numbers it trains are then not exact any more), to see what that piece costs.

- `local_bn`: `Accelerator(sync_batchnorm=False)`: BatchNormalization moments over each
  replica's real rows, without the all-reduces that make them the global batch's
  (`keras_accel.adapter.batchnorm`), as plain Keras computes them;
- `plain_synchronized`: plain `model.fit` with every BatchNormalization layer built
  `synchronized=True`: what plain Keras pays for the global statistics `acc.fit` keeps;
- `no_bn_sync`: the same as `local_bn`, by replacing our installation;
- `no_global_metrics`: the metrics' results read locally instead of across replicas;
- `neither`: both of those;
- `keras_distribution`: the batches fed through Keras's own `experimental_distribute_dataset`
  instead of the Accelerator's replica slices;
- `local_row_count`: the real-row count of each batch without its all-reduce.

    python benchmarks/tf_step_costs.py --model mlp --batch-size 1024
    python benchmarks/tf_step_costs.py --variants keras_distribution,local_row_count

Every variant fits one epoch of `--steps` steps in turn, after a compiling epoch each, for
`--rounds` rounds; the figure is the median time of one step (between two batch ends, so
neither the epoch's start nor its end counts; a batch hook turns host-loop fusion off, for
every variant alike), and plain / variant. Beside them, the medians of what each epoch costs
outside its steps: from the `fit` call to the first step's end less one step (setup, the
epoch's iterator), and from the last step's end to `fit`'s return (the epoch's results,
deleting the iterators: on TensorFlow 2.21, tens of seconds for plain Keras's, see
benchmarks/tf_iterator_deletion.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

VARIANTS = ("acc", "local_bn", "plain_synchronized", "no_bn_sync", "no_global_metrics")
VARIANTS += ("neither", "keras_distribution", "local_row_count")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="steps per epoch")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")

    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_accel.adapter.backends.tensorflow.runtime as tf_backend
    import keras_accel.adapter.session as session
    from keras_accel import Accelerator
    from keras_accel.models import cnn, compile_seed, mlp

    acc = Accelerator(seed=0)
    # Same devices, so the same tf.distribute strategy: acc's models suit it.
    local = Accelerator(seed=0, sync_batchnorm=False)
    rows = args.batch_size * args.steps
    rng = np.random.default_rng(0)
    x = rng.random((rows, 32, 32, 3), dtype="float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, rows), 10)

    def build(name):
        with acc.scope():
            if args.model == "mlp":
                model = mlp(input_shape=(32, 32, 3), num_classes=10)
            else:
                model = cnn(input_shape=(32, 32, 3), num_classes=10, width=0.25)
            if name == "plain_synchronized":
                for layer in model._flatten_layers():
                    if isinstance(layer, keras.layers.BatchNormalization):
                        layer.synchronized = True  # Read when the step is traced.
            return compile_seed(model)

    originals = {
        (session, "install_batchnorm"): session.install_batchnorm,
        (tf_backend, "install_global_results"): tf_backend.install_global_results,
        (tf_backend.Runtime, "distribute"): tf_backend.Runtime.distribute,
        (tf_backend.Runtime, "row_count"): tf_backend.Runtime.row_count,
    }

    def use(variant: str) -> None:
        for (owner, name), value in originals.items():
            setattr(owner, name, value)
        if variant in ("no_bn_sync", "neither"):
            bn = originals[(session, "install_batchnorm")]
            session.install_batchnorm = lambda patches, model, *_: bn(patches, model)
        if variant in ("no_global_metrics", "neither"):
            tf_backend.install_global_results = lambda *args, **kwargs: None
        if variant == "keras_distribution":
            tf_backend.Runtime.distribute = lambda self, pipeline, rows, own=False: (
                self.native.experimental_distribute_dataset(pipeline)
            )
        if variant == "local_row_count":
            tf_backend.Runtime.row_count = lambda self, mask: tf.reduce_sum(
                tf.cast(mask, tf.float32)
            )

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.ends = []
            self.begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

        def step(self) -> float:
            return float(np.median(np.diff(self.ends)))

        def around(self, called: float, returned: float) -> tuple[float, float]:
            """The epoch's cost outside its steps: before the first step, after the last."""
            before = self.ends[0] - called - self.step()
            return before, returned - self.ends[-1]

    names = ["plain", *variants]
    models = {name: build(name) for name in names}

    def epoch(name: str) -> tuple[float, float, float]:
        timer = Timer()
        kwargs = dict(batch_size=args.batch_size, epochs=1, verbose=0, callbacks=[timer])
        called = time.perf_counter()
        if name.startswith("plain"):
            with acc.scope():
                models[name].fit(x, y, **kwargs)
        else:
            use(name)  # Traced under this variant on its first call: each model keeps its own.
            try:
                (local if name == "local_bn" else acc).fit(models[name], x, y, **kwargs)
            finally:
                use("acc")
        returned = time.perf_counter()
        return (timer.step(), *timer.around(called, returned))

    for name in names:
        epoch(name)  # Compilation.
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            times[name].append(epoch(name))

    def median(name: str, column: int) -> float:
        return statistics.median(t[column] for t in times[name])

    plain = median("plain", 0)
    title = f"{args.model}@{args.batch_size}, {acc.num_replicas} replicas"
    print(f"| {title} | s/step | plain / it | s before the first step | s after the last |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        step, before, after = (median(name, column) for column in range(3))
        print(f"| {name} | {step:.3f} | {plain / step:.3f} | {before:.3f} | {after:.3f} |")
    print(f"load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
