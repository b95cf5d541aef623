"""One process of a run whose callbacks include Keras's own file writers, started by
`keras-accel launch` (or alone). Usage:

    python _writers.py WORKDIR [--devices N]

Trains the classifier of `_model.py` two epochs through `Accelerator.fit`, with validation,
under Keras's `TensorBoard(WORKDIR/tb)`, `CSVLogger(WORKDIR/log.csv, append=True)` and
`ModelCheckpoint(WORKDIR/ckpt/model.keras)`, then evaluates with the same TensorBoard. Each
process then writes WORKDIR/writers-<process>.json: where each callback points after the
calls (put back as the script gave it).
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

acc = Accelerator(seed=0, devices=args.devices)
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
    callbacks=[board, logger, checkpoint],
)
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
