"""torch: one process against `keras-accel launch -n 2`, the same global batch (issue 40).

The same model and data as `benchmarks/hand_loop.py`'s dense case (Dense 64 then a 10-way
softmax on 32 features, Adam 1e-3, global batch 64), trained with `acc.fit` in one process
and in two processes on this host (each one half of every global batch, the gradients
all-reduced over gloo), each with its share of the host's cores for torch's threads. It
prints the median seconds per epoch after warm-up epochs, and the scaling: one process's
time over two processes' (above 1: two are faster). Each process count runs compiled
(`backends.torch.compiled` from the second step: `KERAS_ACCEL_JIT_COMPILE=1`) and eager
(`KERAS_ACCEL_JIT_COMPILE=0`).

    python benchmarks/torch_processes.py [--steps 1024] [--rounds 3] [--warmup 3]
        [--metrics accuracy ...]

Each run alternates two kinds of epoch: as the benchmark's fits run (verbose=0: no process
reads a step's logs, so over processes only each epoch's results are reduced) and with a
batch hook on the chief (as a progress bar has), where every process reduces each step's
metrics for its logs.

What it shows on a 2-core CPU host is the per-step cost of several processes (gloo's
collectives, two processes sharing two cores), not what two GPUs give; on a GPU host run it
with the processes the host has GPUs for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args) -> None:
    import keras
    import numpy as np
    import torch

    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // acc.num_processes))
    rows = args.batch * args.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 32)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, rows), 10).astype("float32")
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            keras.optimizers.Adam(1e-3), "categorical_crossentropy", metrics=args.metrics or None
        )
    # A batch hook of the chief's (as a progress bar has) makes every process reduce each
    # step's metrics for its logs; without one, only the epoch's results are reduced. The
    # two alternate, epoch by epoch, so that both see the same load.
    hook = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    modes = {"plain": [], "hooked": [hook] if acc.process_index == 0 else []}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    loss = None
    for epoch in range(args.warmup + args.rounds):
        for mode, callbacks in modes.items():
            started = time.perf_counter()
            history = acc.fit(
                model, x, y, batch_size=args.batch, epochs=1, verbose=0, callbacks=callbacks
            )
            if epoch >= args.warmup:
                times[mode].append(time.perf_counter() - started)
            loss = history.history["loss"][-1]
    if acc.process_index == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "processes": acc.num_processes,
                    "s_per_epoch": statistics.median(times["plain"]),
                    "s_per_epoch_hooked": statistics.median(times["hooked"]),
                    "times": times,
                    "loss": loss,
                    "threads": torch.get_num_threads(),
                },
                f,
            )


def run(processes: int, argv: list[str], **env_extra: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    command = [sys.executable, os.path.abspath(__file__), *argv, "--child", "--out", out]
    if processes > 1:
        launcher = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", str(processes)]
        command = [*launcher, *command[1:]]
    env = dict(os.environ, KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="3", **env_extra)
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise SystemExit(f"{processes} process(es) failed (exit {result.returncode}):\n{tail}")
    with open(out) as f:
        report = json.load(f)
    os.remove(out)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1024, help="global batches per epoch")
    parser.add_argument("--batch", type=int, default=64, help="the global batch size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--metrics", nargs="*", default=[], help="Keras metrics to compile (default none)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    argv = [
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--rounds={args.rounds}",
        f"--warmup={args.warmup}",
        "--metrics",
        *args.metrics,
    ]
    # One process compiles its step (after 2,000 eager steps on "auto": from now on); several
    # run it eagerly, so one eager process is measured too, to tell the two costs apart.
    one = run(1, argv, KERAS_ACCEL_JIT_COMPILE="1")
    eager = run(1, argv, KERAS_ACCEL_JIT_COMPILE="0")
    two = run(2, argv, KERAS_ACCEL_JIT_COMPILE="1")
    two_eager = run(2, argv, KERAS_ACCEL_JIT_COMPILE="0")
    metrics = ", ".join(args.metrics) or "none"
    print(
        f"torch, dense 64, global batch {args.batch}, {args.steps} steps per epoch, "
        f"metrics: {metrics}\n"
    )
    print(
        "| processes | step | torch threads each | s/epoch (median) | with a batch hook "
        "on the chief | final loss |"
    )
    print("|---|---|---|---|---|---|")
    for report, step in (
        (one, "compiled"),
        (eager, "eager"),
        (two, "compiled"),
        (two_eager, "eager"),
    ):
        print(
            f"| {report['processes']} | {step} | {report['threads']} | "
            f"{report['s_per_epoch']:.3f} | {report['s_per_epoch_hooked']:.3f} | "
            f"{report['loss']:.5f} |"
        )
    print(
        f"\nscaling, 1 process / 2 processes: {one['s_per_epoch'] / two['s_per_epoch']:.2f}x "
        f"compiled, {eager['s_per_epoch'] / two_eager['s_per_epoch']:.2f}x eager"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
