"""What a BackupAndRestore every N steps costs training: in the background against blocking.

The seed's MLP (9.1M parameters, Adam: 27M floats of state) trains through `Accelerator.fit`
three ways side by side in one process, one fit of each per round, in turn, so that machine
noise hits them alike: without checkpoints, with `BackupAndRestore(save_freq=N)` saving in
the background (the default: Orbax on JAX, tf.train on TensorFlow), and with
`save_on_background=False`. Steady state is measured: each fit runs several epochs, and the
epochs after the first (which compiles, opens the engine and checks the directory) are timed
from epoch start to epoch end, saves included. Beside it: the time to copy the whole training
state to host memory, the floor a blocking save cannot go below. Every backend runs in its
own child process.

    python benchmarks/checkpoint_overhead.py --backends jax,tensorflow

Prints a Markdown table; `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("none", "background", "blocking")


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    import keras
    import numpy as np

    from keras_accel import Accelerator
    from keras_accel.callbacks import BackupAndRestore
    from keras_accel.models import compile_seed, mlp

    acc = Accelerator(seed=0)
    rng = np.random.default_rng(0)
    rows = args.steps * args.batch_size
    x = rng.random((rows, 3072), dtype="float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, rows), 10)
    models = {}
    for config in CONFIGS:
        with acc.scope():
            models[config] = compile_seed(mlp(input_shape=(3072,)))
    parameters = models["none"].count_params()
    times: dict[str, list[float]] = {config: [] for config in CONFIGS}
    # Time the training thread spends inside BackupAndRestore.save: its share of a save.
    blocked: dict[str, list[float]] = {config: [] for config in CONFIGS}
    save = BackupAndRestore.save

    def timed_save(self, *args_, **kwargs):
        started = time.perf_counter()
        try:
            return save(self, *args_, **kwargs)
        finally:
            config = "background" if self.save_on_background else "blocking"
            blocked[config].append(time.perf_counter() - started)

    BackupAndRestore.save = timed_save

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self, config):
            super().__init__()
            self.config = config

        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch > 0:  # The first compiles and opens the engine.
                times[self.config].append(time.perf_counter() - self.started)

    root = tempfile.mkdtemp(prefix="keras_accel-bench-")
    try:
        for _ in range(args.rounds):
            for config in CONFIGS:
                callbacks = [EpochTimer(config)]
                if config != "none":
                    directory = tempfile.mkdtemp(dir=root)
                    # The timer runs after the backup, so an epoch's last save is in it.
                    callbacks.insert(
                        0,
                        BackupAndRestore(
                            directory,
                            save_freq=args.save_every,
                            save_on_background=config == "background",
                            max_to_keep=2,
                        ),
                    )
                acc.fit(
                    models[config],
                    x,
                    y,
                    batch_size=args.batch_size,
                    epochs=args.epochs,
                    shuffle=False,
                    verbose=0,
                    callbacks=callbacks,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    model = models["none"]
    state = list(model.variables) + list(model.optimizer.variables)
    copies = []
    for _ in range(5):
        started = time.perf_counter()
        for variable in state:
            np.asarray(keras.ops.convert_to_numpy(variable.value))
        copies.append(time.perf_counter() - started)
    median = {config: statistics.median(values) for config, values in times.items()}
    saves = args.steps // args.save_every
    return {
        "backend": acc.backend,
        "replicas": acc.num_replicas,
        "parameters": parameters,
        "state_bytes": sum(int(np.prod(v.shape)) * 4 for v in state),
        "steps": args.steps,
        "save_every": args.save_every,
        "saves": saves,
        "seconds": median,
        "step_ms": {c: 1000 * s / args.steps for c, s in median.items()},
        "per_save_s": {c: (median[c] - median["none"]) / saves for c in CONFIGS[1:]},
        "slowdown": {c: median[c] / median["none"] - 1 for c in CONFIGS[1:]},
        "host_copy_s": statistics.median(copies),
        "blocked_per_save_s": {c: statistics.median(blocked[c]) for c in CONFIGS[1:]},
    }


def _child(backend: str, argv: list[str]) -> dict:
    return run_child(os.path.join(HERE, "checkpoint_overhead.py"), backend, argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per fit")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    common = [
        f"--devices={args.devices}",
        f"--steps={args.steps}",
        f"--batch-size={args.batch_size}",
        f"--save-every={args.save_every}",
        f"--rounds={args.rounds}",
        f"--epochs={args.epochs}",
    ]
    rows = [_child(backend, common) for backend in args.backends.split(",")]
    print(
        "| backend | parameters | state MiB | step ms, no checkpoint | slowdown, background | "
        "slowdown, blocking | training s lost per save, background | ... blocking | "
        "save() blocks, background | ... blocking | host copy of the state, s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | error: {row['error']} |")
            continue
        print(
            f"| {row['backend']} | {row['parameters'] / 1e6:.1f}M | "
            f"{row['state_bytes'] / 2**20:.0f} | {row['step_ms']['none']:.1f} | "
            f"{row['slowdown']['background']:+.1%} | {row['slowdown']['blocking']:+.1%} | "
            f"{row['per_save_s']['background']:.3f} | {row['per_save_s']['blocking']:.3f} | "
            f"{row['blocked_per_save_s']['background']:.3f} | "
            f"{row['blocked_per_save_s']['blocking']:.3f} | {row['host_copy_s']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
