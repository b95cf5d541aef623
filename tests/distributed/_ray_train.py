"""The training function the Ray tests (test_ray.py) hand to Ray Train's trainers, unchanged
from a keras_accel script: an Accelerator, `acc.fit` with BackupAndRestore, the weights
written by the chief. Also run alone, as the one-process reference:

    KERAS_BACKEND=torch python tests/distributed/_ray_train.py WORKDIR

`config`: `workdir` (the backup directory and the weights go there), and `kill` ("rank:
epoch:batch"): that worker SIGKILLs itself at the end of that batch, once over the run's
attempts (a marker file in `workdir` says it happened), as a machine lost mid-epoch would.
The chief writes WORKDIR/weights-<n>.npz, n counting the attempts that reached the end.
"""

import os
import signal
import sys

import numpy as np

EPOCHS = 3
ROWS = 96
BATCH = 16  # 6 steps an epoch; a backup every 2 (steps 2, 4, ..., 18).
SAVE_FREQ = 2


def train(config: dict) -> None:
    import keras

    from keras_accel import Accelerator
    from keras_accel.callbacks import BackupAndRestore

    acc = Accelerator(seed=0)  # First, before anything computes: it joins Ray's cluster.
    workdir = config["workdir"]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _model import compiled_classifier

    model = compiled_classifier(acc)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    callbacks = [
        BackupAndRestore(os.path.join(workdir, "backup"), save_freq=SAVE_FREQ),
        # In every run, killing or not: the same callbacks, so the same steps per host call.
        _KillOnce(acc.process_index, config.get("kill", "-1:-1:-1"), workdir),
    ]
    acc.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    if acc.is_chief:
        done = len([n for n in os.listdir(workdir) if n.startswith("weights-")])
        np.savez(
            os.path.join(workdir, f"weights-{done}.npz"),
            *[np.asarray(w) for w in model.get_weights()],
            iterations=int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            processes=acc.num_processes,
        )


class _KillOnce:
    """SIGKILL this worker at the end of `epoch:batch` if it is `rank`, the first time."""

    def __new__(cls, process_index: int, kill: str, workdir: str):
        import keras

        rank, epoch, batch = (int(part) for part in kill.split(":"))
        marker = os.path.join(workdir, "killed")

        class KillOnce(keras.callbacks.Callback):
            def on_epoch_begin(self, at, logs=None):
                self.epoch = at

            def on_train_batch_end(self, at, logs=None):
                if process_index != rank or os.path.exists(marker):
                    return
                if (self.epoch, at) == (epoch, batch):
                    with open(marker, "w") as f:
                        f.write(f"{os.getpid()}\n")
                    os.kill(os.getpid(), signal.SIGKILL)

        return KillOnce()


if __name__ == "__main__":
    train({"workdir": sys.argv[1]})
