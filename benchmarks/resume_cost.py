"""What a mid-epoch resume costs: the wall time from a restart to the end of the stopped epoch,
for a run stopped late in the epoch and one stopped early, replayed (before issue 61) and
begun at the backup's batch (after).

An MLP trains through `Accelerator.fit` on one device with `BackupAndRestore(save_freq=S)`
over an epoch of M steps; a fit is stopped (an exception, right after the backup) `early`
(S batches in) or `late` (M - S batches in), and the same fit is started again on a model
built afresh, in the same process: the time from that call to its end (the restore, the
compilation, the remaining steps, or under "replay" the epoch's first batches again) is what
a restart costs. The restarted fit, and the fit that times an epoch, save no backups
(`save_freq=False`): a save costs as much wherever it falls, and a replay skips those of the
batches it re-runs, which would credit it with saves it merely postpones. The two ways are
measured side by side, in turn, each round, so that the machine's noise hits them alike:
"replay" forces the old way (the Accelerator is told its data cannot begin late,
`keras_accel.adapter.run.begin_late`), "begin late" is the default.
The figure the issue asks for: how much sooner the late restart ends than the early one, as
a fraction of the epoch's steps (`(early - late) / epoch`): about 0 where a restart re-runs
the epoch, `(M - 2S) / M` where it starts at the batch. Every backend runs in its own child
process; `--inputs` names arrays and/or a `keras.utils.PyDataset`.

    python benchmarks/resume_cost.py --backends jax,tensorflow,torch --inputs arrays,pydataset

Prints a Markdown table; `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
WAYS = ("replay", "begin late")


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(1)
    import keras
    import numpy as np

    from keras_accel import Accelerator
    from keras_accel.adapter import run
    from keras_accel.callbacks import BackupAndRestore

    acc = Accelerator(seed=0, jit_compile=False)
    rng = np.random.default_rng(0)
    rows = args.steps * args.batch_size
    x = rng.normal(size=(rows, args.features)).astype("float32")
    y = rng.integers(0, 10, rows)

    class Rows(keras.utils.PyDataset):
        def __len__(self):
            return args.steps

        def __getitem__(self, index):
            cut = slice(index * args.batch_size, (index + 1) * args.batch_size)
            return x[cut], y[cut]

    def model():
        with acc.scope():
            made = keras.Sequential(
                [
                    keras.Input((args.features,)),
                    keras.layers.Dense(args.width, activation="relu"),
                    keras.layers.Dense(args.width, activation="relu"),
                    keras.layers.Dense(10),
                ]
            )
            made.compile(
                keras.optimizers.SGD(0.01, momentum=0.9),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        return made

    class Stop(Exception):
        pass

    class StopAt(keras.callbacks.Callback):
        def __init__(self, batch):
            super().__init__()
            self.batch = batch

        def on_train_batch_end(self, batch, logs=None):
            if batch == self.batch:
                raise Stop

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.started  # The last epoch's.

    def fit(inputs, directory, callbacks, epochs=1, save_freq=False):
        data = (x, y) if inputs == "arrays" else (Rows(), None)
        batch_size = args.batch_size if inputs == "arrays" else None
        backup = BackupAndRestore(directory, save_freq=save_freq)
        acc.fit(
            model(),
            *data,
            batch_size=batch_size,
            epochs=epochs,
            verbose=0,
            callbacks=[backup, *callbacks],
        )

    class Steps(keras.callbacks.Callback):
        """The training steps a fit runs (replayed ones too: their batch ends are seen)."""

        def __init__(self):
            super().__init__()
            self.count = 0

        def on_train_batch_end(self, batch, logs=None):
            self.count += 1

    def restart(inputs, way, done) -> tuple[float, int]:
        """Stop a fit after `done` batches, start it again: the restart's seconds, steps."""
        directory = tempfile.mkdtemp(dir=root)
        with contextlib.suppress(Stop):
            fit(inputs, directory, [StopAt(done - 1)], save_freq=args.save_every)
        run.begin_late = (lambda *a: False) if way == "replay" else begin_late
        steps = Steps()
        try:
            started = time.perf_counter()
            fit(inputs, directory, [steps])
            return time.perf_counter() - started, steps.count
        finally:
            run.begin_late = begin_late

    begin_late = run.begin_late
    points = {"early": args.save_every, "late": args.steps - args.save_every}
    root = tempfile.mkdtemp(prefix="keras_accel-bench-")
    results = {}
    try:
        for inputs in args.inputs.split(","):
            restarts = {(way, at): [] for way in WAYS for at in points}
            steps_run = {}
            epoch = []
            restart(inputs, "begin late", points["early"])  # Warm-up, not timed.
            for round_ in range(args.rounds):
                timer = EpochTimer()  # An uninterrupted epoch's steps: the second epoch's.
                fit(inputs, tempfile.mkdtemp(dir=root), [timer], epochs=2)
                epoch.append(timer.seconds)
                flip = round_ % 2 == 1  # Each order in turn, against drift.
                for at, done in reversed(points.items()) if flip else points.items():
                    for way in reversed(WAYS) if flip else WAYS:
                        seconds, steps_run[(way, at)] = restart(inputs, way, done)
                        restarts[(way, at)].append(seconds)
            median = {f"{way}, {at}": statistics.median(v) for (way, at), v in restarts.items()}
            epoch_s = statistics.median(epoch)
            results[inputs] = {
                "restart_s": median,
                "late_restart_steps": {way: steps_run[(way, "late")] for way in WAYS},
                "epoch_s": epoch_s,
                "saved_fraction": {
                    way: (median[f"{way}, early"] - median[f"{way}, late"]) / epoch_s
                    for way in WAYS
                },
            }
    finally:
        run.begin_late = begin_late
        shutil.rmtree(root, ignore_errors=True)
    return {
        "backend": acc.backend,
        "steps": args.steps,
        "save_every": args.save_every,
        "ideal": (args.steps - 2 * args.save_every) / args.steps,
        "inputs": results,
    }


def _child(backend: str, argv: list[str]) -> dict:
    return run_child(os.path.join(HERE, "resume_cost.py"), backend, argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow,torch")
    parser.add_argument("--inputs", default="arrays,pydataset")
    parser.add_argument("--steps", type=int, default=400, help="steps per epoch (M)")
    parser.add_argument("--save-every", type=int, default=20, help="save_freq (S)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    common = [
        f"--inputs={args.inputs}",
        f"--steps={args.steps}",
        f"--save-every={args.save_every}",
        f"--batch-size={args.batch_size}",
        f"--features={args.features}",
        f"--width={args.width}",
        f"--rounds={args.rounds}",
    ]
    rows = [_child(backend, common) for backend in args.backends.split(",")]
    print(
        "| backend | input | epoch s | restart s, replay, early | ... late | "
        "restart s, begin late, early | ... late | saved fraction, replay | "
        "... begin late | ideal | steps run by the late restart, replay | ... begin late |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | error: {row['error']} |")
            continue
        for inputs, figures in row["inputs"].items():
            s, f = figures["restart_s"], figures["saved_fraction"]
            n = figures["late_restart_steps"]
            print(
                f"| {row['backend']} | {inputs} | {figures['epoch_s']:.2f} | "
                f"{s['replay, early']:.2f} | {s['replay, late']:.2f} | "
                f"{s['begin late, early']:.2f} | {s['begin late, late']:.2f} | "
                f"{f['replay']:.2f} | {f['begin late']:.2f} | {row['ideal']:.2f} | "
                f"{n['replay']} | {n['begin late']} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
