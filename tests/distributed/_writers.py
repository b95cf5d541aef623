"""One process of a run whose callbacks include Keras's own file writers, started by
`keras-accel launch` (or alone). Usage:

    python _writers.py WORKDIR [--devices N]

Trains the classifier of `_model.py` two epochs through `Accelerator.fit`, with validation,
under Keras's `TensorBoard(WORKDIR/tb)`, `CSVLogger(WORKDIR/log.csv, append=True)` and
`ModelCheckpoint(WORKDIR/ckpt/model.keras)`, then evaluates with the same TensorBoard. Each
process then writes WORKDIR/writers-<process>.json: where each callback points after the
calls (put back as the script gave it).

Beside them, a tracker's logger as W&B's and MLflow's Keras callbacks are (`RunLogger`: a
run of its own in every process that builds one, each epoch's logs appended to it), once
wrapped in `chief_only` (WORKDIR/tracked/) and once bare (WORKDIR/untracked/), and a
`CSVLogger` wrapped in `chief_only` (WORKDIR/chief.csv), which acc.fit's own redirection of
Keras's writers does not see. And W&B's own `WandbMetricsLogger`, offline, as docs/trackers.md
sets it up (the run and the callback on the chief): its run under WORKDIR/wandb/.
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("workdir")
parser.add_argument("--devices", type=int, default=None)
args = parser.parse_args()

import keras_accel  # noqa: E402

if args.devices is not None:
    keras_accel.configure_virtual_cpu_devices(args.devices)

import keras  # noqa: E402
from _model import compiled_classifier  # noqa: E402  (this folder: scripts run as scripts)

from keras_accel import Accelerator  # noqa: E402
from keras_accel.callbacks import chief_only  # noqa: E402


class RunLogger(keras.callbacks.Callback):
    """A tracker's logger: a run file of its own in each process (`wandb.init` in each),
    each epoch's logs appended."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def on_train_begin(self, logs=None):
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder, f"run-{os.getpid()}.jsonl")
        open(self.path, "a").close()

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch, **{key: float(value) for key, value in logs.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


acc = Accelerator(seed=0, devices=args.devices)
# W&B as docs/trackers.md's recipe has it: the run and its callback on the chief alone.
import wandb  # noqa: E402
from wandb.integration.keras import WandbMetricsLogger  # noqa: E402

if acc.is_chief:
    wandb.init(project="keras-accel-tests", mode="offline", dir=args.workdir)
tracker = [WandbMetricsLogger()] if acc.is_chief else []
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
model = compiled_classifier(acc)
workdir = args.workdir
board = keras.callbacks.TensorBoard(os.path.join(workdir, "tb"))
logger = keras.callbacks.CSVLogger(os.path.join(workdir, "log.csv"), append=True)
checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(workdir, "ckpt", "model.keras"))
acc.fit(
    model,
    x,
    y,
    batch_size=16,
    epochs=2,
    validation_data=(x[:32], y[:32]),
    verbose=0,
    callbacks=[
        board,
        logger,
        checkpoint,
        chief_only(RunLogger(os.path.join(workdir, "tracked"))),
        RunLogger(os.path.join(workdir, "untracked")),
        chief_only(keras.callbacks.CSVLogger(os.path.join(workdir, "chief.csv"))),
        *tracker,
    ],
)
if acc.is_chief:
    wandb.finish()
acc.evaluate(model, x, y, batch_size=16, verbose=0, callbacks=[board])
with open(os.path.join(workdir, f"writers-{acc.process_index}.json"), "w") as f:
    json.dump(
        {
            "log_dir": board.log_dir,
            "filename": logger.filename,
            "filepath": checkpoint.filepath,
        },
        f,
    )
