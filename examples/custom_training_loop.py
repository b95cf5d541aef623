"""The CIFAR-10 benchmark's MLP through a custom training loop: one loop for JAX and TensorFlow.

    KERAS_BACKEND=jax python examples/custom_training_loop.py
    KERAS_BACKEND=tensorflow python examples/custom_training_loop.py --virtual-devices 8

The loop is yours (epochs, batches, what to print); keras_accel compiles the step for the
backend and the devices, averages the loss over the global batch, and reads the metrics
across replicas. Uses CIFAR-10 when it is found locally, else synthetic data of its shape,
and says which; the row count is not a multiple of the batch on purpose (the last batch is
padded, not a crash, not a recompilation). The seed's wish is in it too: the learning rate
divided by 10 at half of training, set every step.

Needs the backend's extra only (README's first set-up command installs both: `jax`,
`tensorflow`).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10000, help="training rows to use")
    parser.add_argument("--test-samples", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="the global batch")
    parser.add_argument("--width", type=float, default=1.0, help="the seed MLP's width factor")
    parser.add_argument("--virtual-devices", type=int, default=None,
                        help="split the CPU into N devices first")  # fmt: skip
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="train N batches per compiled call (host-loop fusion)")  # fmt: skip
    args = parser.parse_args()

    import keras_accel

    if args.virtual_devices:
        keras_accel.configure_virtual_cpu_devices(args.virtual_devices)
    import keras

    from keras_accel import Accelerator
    from keras_accel.data import load_cifar10
    from keras_accel.models import mlp
    from keras_accel.schedules import PiecewiseConstant

    acc = Accelerator(seed=0)
    print(f"backend:  {acc.backend}, {acc.strategy_name} over {acc.num_replicas} replica(s)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The line below says where the data came from.
        cifar = load_cifar10(num_samples=args.samples, num_test_samples=args.test_samples)
    (x, y), (x_test, y_test) = cifar
    print(f"data:     {cifar.source}; train {x.shape}, test {x_test.shape}")

    steps_per_epoch = -(-len(x) // args.batch_size)
    divide_at_half = PiecewiseConstant([1e-3, 1e-4], boundaries=[0.5], unit="fraction")
    with acc.scope():
        model = mlp(input_shape=x.shape[1:], num_classes=10, width=args.width)
        optimizer = keras.optimizers.Adam(
            divide_at_half.with_total_steps(args.epochs * steps_per_epoch)
        )
    loop = acc.loop(
        model,
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(),
        metrics=[keras.metrics.CategoricalAccuracy("accuracy")],
    )
    print(f"model:    the seed MLP, {model.count_params():,} parameters")

    started = time.perf_counter()
    for epoch in range(args.epochs):
        loop.reset_metrics()
        for batch in loop.batches(
            x, y, batch_size=args.batch_size, shuffle=True, epoch=epoch,
            steps_per_execution=args.steps_per_execution,
        ):  # fmt: skip
            loop.train_step(batch)  # One batch, or a StepGroup of N in one call.
        train = loop.results()
        test = loop.evaluate(x_test, y_test, batch_size=args.batch_size)
        print(
            f"epoch {epoch + 1}: loss {train['loss']:.4f}, accuracy {train['accuracy']:.4f}, "
            f"test loss {test['loss']:.4f}, test accuracy {test['accuracy']:.4f}"
        )
    seconds = time.perf_counter() - started
    predictions = loop.predict(x_test, batch_size=args.batch_size)
    traces = loop.traces
    print(f"predict:  {predictions.shape[0]} rows of {predictions.shape[1]} probabilities")
    print(f"time:     {seconds:.1f} s for {args.epochs} epochs; compilations {traces}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
