"""One run of the resharding test, in its own process (a device count is fixed per process).

Usage: python _reshard_script.py WORKDIR BACKUP DEVICES STRATEGY EPOCHS NAME

Builds the test's seeded model (Dense 32 -> BatchNormalization -> Dense 3, Adam) under
`Accelerator(strategy=STRATEGY)` on DEVICES virtual CPU devices and fits it for EPOCHS epochs
with `BackupAndRestore(WORKDIR/BACKUP, delete_checkpoint=False)`: a backup made by an earlier
run (another strategy, another device count) is restored first. Writes every weight and
optimizer variable, keyed by path, to WORKDIR/NAME.npz, and the layout of the first kernel to
WORKDIR/NAME.layout. Under `keras-accel launch` (several processes, DEVICES each) the
arrays are gathered from every process and the chief writes them.
"""

import os
import sys

import numpy as np

import keras_accel

workdir, backup_dir, devices, strategy, epochs, name = sys.argv[1:]
keras_accel.configure_virtual_cpu_devices(int(devices))

import keras  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from keras_accel.callbacks import BackupAndRestore  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from tests.callbacks.test_reshard import build, data, state  # noqa: E402

acc = Accelerator(strategy=strategy, seed=0)
with acc.scope():
    model = build()
x, y = data()
backup = BackupAndRestore(os.path.join(workdir, backup_dir), delete_checkpoint=False)
acc.fit(
    model, x, y, batch_size=16, epochs=int(epochs), shuffle=False, verbose=0, callbacks=[backup]
)
if acc.num_processes > 1:  # Each process holds its shards: gather every array whole.
    from jax.experimental import multihost_utils

    variables = [*model.weights, *model.optimizer.variables]
    values = {
        v.path.replace("/", "|"): multihost_utils.process_allgather(v.value, tiled=True)
        for v in variables
    }
else:
    values = state(model)
if not acc.is_chief:
    sys.exit(0)
np.savez(os.path.join(workdir, f"{name}.npz"), **values)
kernel = model.get_layer("wide").kernel.value
layout = ""
if keras.backend.backend() == "jax":
    layout = str(getattr(kernel.sharding, "spec", "one device"))
with open(os.path.join(workdir, f"{name}.layout"), "w") as f:
    f.write(layout)
