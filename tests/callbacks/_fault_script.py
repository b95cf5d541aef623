"""A run of the fault matrix's model killed inside a backup's commit, in its own process.

Usage: python tests/callbacks/_fault_script.py BACKUP_DIR

Trains tests/callbacks/test_faults.py's model with BackupAndRestore (a backup each epoch,
at steps 4, 8, 12) and SIGKILLs itself while the engine commits step 8: on JAX and torch
inside the checksum record's write (Orbax's writer thread after its handlers finalized the
step, before the rename; DCP's `finish` before `.metadata`), the last moment before the
commit; on TensorFlow, whose background write runs in TensorFlow's own thread, right after
`save` handed step 8 to it (the write is then in flight, or just done). The process never
returns normally.
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402

from keras_accel.callbacks import BackupAndRestore  # noqa: E402
from keras_accel.state import checksums  # noqa: E402
from tests.callbacks.test_faults import EPOCHS, fit, model  # noqa: E402

KILL_AT = 8


def _kill_in_the_commit_of(step: int, seal_of) -> None:
    """SIGKILL this process when the commit of `step` writes its checksum record."""
    real = checksums.seal

    def seal(root, skip=(), **signed):  # `key`, `step`: the signing of the record.
        if seal_of(root) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(root, skip, **signed)

    checksums.seal = seal


def main(backup_dir: str) -> None:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_accel.state.engines import tf_train

        real_save = tf_train.Engine.save

        def save(self, step, variables, meta):
            real_save(self, step, variables, meta)
            if step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)

        tf_train.Engine.save = save
    elif backend == "jax":
        # Orbax's temporary directory of the step: `8.orbax-checkpoint-tmp`.
        _kill_in_the_commit_of(KILL_AT, lambda root: int(os.path.basename(root).split(".")[0]))
    else:
        _kill_in_the_commit_of(KILL_AT, lambda root: int(os.path.basename(root)[len("dcp-") :]))
    fit(model(), BackupAndRestore(backup_dir), epochs=EPOCHS)
    raise SystemExit("the kill inside the commit of step 8 never came")


if __name__ == "__main__":
    main(sys.argv[1])
