"""One process of a multi-process run, started by `keras-accel launch` (or alone, as the
one-process reference). Usage:

    python _train.py WORKDIR [--devices N] [--die PROCESS:STEP] [--stop PROCESS:STEP]
                     [--stall-at STEP]

Trains a small seeded model (Dense, BatchNormalization; SGD with momentum) through
`Accelerator.fit` on 100 rows in global batches of 16 (7 steps per epoch, the last padded,
so the rows split unevenly over processes), 3 epochs, shuffled, with BackupAndRestore
(save_freq=3 steps, backups kept), History(path) and ModelCheckpoint (weights per epoch).
At the end every process writes its final weights, loss history, evaluation and
predictions to WORKDIR/result-<process>.npz.

Every file keras_accel writes itself (through `keras_accel.state.files`, and model files
through ModelCheckpoint's saver) is logged to WORKDIR/writes-<process>.txt, so a test can
see which process wrote what.

--die P:S     process P SIGKILLs itself at the end of global step S.
--stop P:S    process P SIGSTOPs itself at the end of global step S (a stuck host, a frozen
              file system: it stops answering without exiting).
--loop custom the same training through `Accelerator.loop` (a custom loop), no callbacks.
--stall-at S  every process writes WORKDIR/at-<S>-<process> at step S and then sleeps 0.3 s
              per step (a window for a test to send SIGTERM).
--backup URL  BackupAndRestore's directory (WORKDIR/backup unless given: an s3:// URL),
              saying what it restored (verbose=1).
--strategy S  the Accelerator's strategy (fsdp: kernels split over the processes' devices).
--then-defaults  after the results are written, one more epoch with BackupAndRestore at its
              defaults (deleting its backups at the end, which every process takes part in)
              into WORKDIR/backup-defaults; each process then writes
              WORKDIR/defaults-<process>.done.
"""

import argparse
import atexit
import os
import signal
import time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("workdir")
parser.add_argument("--devices", type=int, default=None)
parser.add_argument("--die", default=None)
parser.add_argument("--stop", default=None)
parser.add_argument("--stall-at", type=int, default=None)
parser.add_argument("--loop", choices=["fit", "custom"], default="fit")
parser.add_argument("--then-defaults", action="store_true")
parser.add_argument("--backup", default=None)
parser.add_argument("--strategy", default=None)
args = parser.parse_args()

import keras_accel  # noqa: E402

if args.devices is not None:
    keras_accel.configure_virtual_cpu_devices(args.devices)

import keras  # noqa: E402
from _model import compiled_classifier  # noqa: E402  (this folder: scripts run as scripts)

from keras_accel import Accelerator  # noqa: E402
from keras_accel.callbacks import (  # noqa: E402
    BackupAndRestore,
    History,
    ModelCheckpoint,
    _saving,  # noqa: E402
)
from keras_accel.state import files  # noqa: E402

_EXIT = {}  # The process index, once known.


def _at_exit():
    # Registered before the Accelerator's own exit handler, so run after it: on torch, the
    # process group it joined must be gone by then (torch's own teardown of it aborts now
    # and then). Written for test_multi_process.
    if keras.backend.backend() == "torch" and "me" in _EXIT:
        import json

        import torch.distributed as dist

        path = os.path.join(args.workdir, f"exit-{_EXIT['me']}.json")
        with open(path, "w") as f:
            json.dump({"initialized": dist.is_initialized()}, f)


atexit.register(_at_exit)
# The Accelerator first: a multi-process run joins its cluster before anything computes.
acc = Accelerator(
    seed=0, devices=args.devices, **({"strategy": args.strategy} if args.strategy else {})
)
me = acc.process_index
_EXIT["me"] = me
log = os.path.join(args.workdir, f"writes-{me}.txt")
for module, name in (
    (files, "write_atomic"),
    (files, "create_new"),
    (files, "upload"),
    (_saving, "save"),
):
    original = getattr(module, name)

    def logged(*call, _original=original, _name=name, **options):
        path = call[1] if _name == "save" else call[0]  # save(model, path, ...)
        with open(log, "a") as f:
            f.write(f"{_name} {path}\n")
        return _original(*call, **options)

    setattr(module, name, logged)


class Events(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if args.die and args.die == f"{me}:{self.step}":
            os.kill(os.getpid(), signal.SIGKILL)
        if args.stop and args.stop == f"{me}:{self.step}":
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.stall_at is not None and self.step >= args.stall_at:
            if self.step == args.stall_at:
                open(os.path.join(args.workdir, f"at-{self.step}-{me}"), "w").close()
            time.sleep(0.3)


model = compiled_classifier(acc)
rng = np.random.default_rng(0)
x = rng.normal(size=(100, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
if args.loop == "fit":
    history = History(os.path.join(args.workdir, "history.json"))
    backup = BackupAndRestore(
        args.backup or os.path.join(args.workdir, "backup"),
        save_freq=3,
        delete_checkpoint=False,
        verbose=int(args.backup is not None),
    )
    models = ModelCheckpoint(
        os.path.join(args.workdir, "model-{epoch}.weights.h5"), save_weights_only=True
    )
    acc.fit(
        model,
        x,
        y,
        batch_size=16,
        epochs=3,
        shuffle=True,
        verbose=0,
        callbacks=[history, backup, Events(), models],
    )
    losses = history.history["loss"]
    evaluation = acc.evaluate(model, x, y, verbose=0)
    predictions = acc.predict(model, x, verbose=0)
else:
    loop = acc.loop(model)
    losses = []
    for epoch in range(3):
        loop.reset_metrics()
        for batch in loop.batches(x, y, batch_size=16, shuffle=True, epoch=epoch):
            loop.train_step(batch)
        losses.append(loop.results()["loss"])
    evaluation = list(loop.evaluate(x, y, batch_size=16).values())
    predictions = loop.predict(x, batch_size=16)


def whole(value):
    """A weight's value, gathered from every process where it is split (fsdp)."""
    if getattr(value, "is_fully_addressable", True):
        return keras.ops.convert_to_numpy(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


np.savez(
    os.path.join(args.workdir, f"result-{me}.npz"),
    loss=np.asarray(losses),
    evaluation=np.asarray(evaluation),
    predictions=predictions,
    **{f"w{i}": whole(v.value) for i, v in enumerate(model.weights)},
)
if args.then_defaults:
    acc.fit(
        model,
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[BackupAndRestore(os.path.join(args.workdir, "backup-defaults"))],
    )
    open(os.path.join(args.workdir, f"defaults-{me}.done"), "w").close()
print(f"process {me} of {acc.num_processes}: done", flush=True)
