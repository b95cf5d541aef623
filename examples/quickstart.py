"""Train the CIFAR-10 benchmark's MLP through the Accelerator, on whatever devices there are.

    KERAS_BACKEND=jax python examples/quickstart.py
    KERAS_BACKEND=tensorflow python examples/quickstart.py --virtual-devices 8

Uses CIFAR-10 when it is found locally (Keras's dataset cache, or KERAS_ACCEL_CIFAR10),
otherwise synthetic data of the same shape, and says which. The sample count is not a
multiple of the batch size on purpose: the last, partial batch is padded, not a crash and
not a recompilation.

What to expect: on JAX a few seconds per epoch on a laptop CPU. On TensorFlow with several
CPU devices (`--virtual-devices 8`), TensorFlow first builds one program per replica, one
after the other on the same few cores: minutes before the first epoch ends (2.5 on a busy
2-core machine), then seconds per epoch. So there the default is 2000 training rows, not
10000 (`--samples`; 10000 take about 5 minutes there), and the script says what it waits for.

Needs the backend's extra only (README's first set-up command installs both: `jax`,
`tensorflow`).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


SAMPLES = 10000
# On several TensorFlow CPU replicas each step runs every replica's program in turn on the
# same cores: 2000 rows keep an epoch to seconds there (the first one's program builds aside).
FEW_SAMPLES = 2000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help=f"training rows to use (default {SAMPLES}; {FEW_SAMPLES} on several TensorFlow "
        "CPU replicas)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--mixed-precision", default=None, choices=[None, "bfloat16", "float16"])
    parser.add_argument(
        "--virtual-devices", type=int, default=None, help="split the CPU into N devices first"
    )
    args = parser.parse_args()

    import keras_accel

    if args.virtual_devices:
        keras_accel.configure_virtual_cpu_devices(args.virtual_devices)
    from keras_accel import Accelerator
    from keras_accel.data import load_cifar10
    from keras_accel.models import compile_seed, mlp

    acc = Accelerator(strategy=args.strategy, mixed_precision=args.mixed_precision, seed=0)
    print(f"backend:  {acc.backend}")
    print(f"devices:  {', '.join(acc.devices)}")
    print(f"strategy: {acc.strategy_name} ({acc.num_replicas} replicas)")
    tf_cpu_replicas = (
        acc.backend == "tensorflow"
        and acc.num_replicas > 1
        and all(d.startswith("cpu") for d in acc.devices)
    )
    samples = args.samples or (FEW_SAMPLES if tf_cpu_replicas else SAMPLES)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The line below prints where the data came from.
        cifar = load_cifar10(num_samples=samples, num_test_samples=2000)
    (x_train, y_train), (x_test, y_test) = cifar
    print(f"data:     {cifar.source}")
    print(f"          train {x_train.shape}, test {x_test.shape}")
    if tf_cpu_replicas and args.samples is None:
        print(f"          ({FEW_SAMPLES} rows: the default on TensorFlow CPU replicas; --samples)")

    with acc.scope():
        model = compile_seed(mlp(input_shape=x_train.shape[1:], num_classes=10))
    print(f"model:    the CIFAR-10 benchmark's MLP, {model.count_params():,} parameters")

    steps = -(-len(x_train) // args.batch_size)
    print(f"training: {args.epochs} epoch(s) of {steps} steps of {args.batch_size} rows", end="")
    if tf_cpu_replicas:
        # Nothing prints while the programs are built: say what the wait is.
        print(
            f"; TensorFlow first builds a program for each of the {acc.num_replicas} "
            "replicas, one after another on these cores: minutes before epoch 1 ends",
            end="",
        )
    print(flush=True)
    start = time.perf_counter()
    history = acc.fit(
        model,
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        verbose=2,
    )
    seconds = time.perf_counter() - start
    for epoch in range(args.epochs):
        print(
            f"epoch {epoch + 1}: loss {history.history['loss'][epoch]:.4f}, "
            f"accuracy {history.history['accuracy'][epoch]:.4f}, "
            f"val_loss {history.history['val_loss'][epoch]:.4f}, "
            f"val_accuracy {history.history['val_accuracy'][epoch]:.4f}"
        )
    loss, accuracy = acc.evaluate(model, x_test, y_test, batch_size=args.batch_size, verbose=0)
    predictions = acc.predict(model, x_test, batch_size=args.batch_size, verbose=0)
    print(f"test:     loss {loss:.4f}, accuracy {accuracy:.4f}, {len(predictions)} predictions")
    print(
        f"time:     {seconds:.1f} s for {args.epochs} epochs; recompiles after warm-up: "
        f"{acc.num_recompiles}"
    )


if __name__ == "__main__":
    main()
