"""Training callbacks that keep working under distribution, resume exactly, and write anywhere.

Import them in place of Keras's:

```python
from keras_accel.callbacks import BackupAndRestore, History, LearningRateScheduler, ModelCheckpoint
```

Each takes Keras's arguments with Keras's meaning, works with `model.fit` and
`Accelerator.fit` on JAX, TensorFlow and torch under every strategy, writes from the chief
process only, and writes to local paths or URLs (`gs://`, `s3://`, `memory://`) through
`keras_accel.state.files` (fsspec, which picks the storage by the URL alone). See
docs/callbacks.md.

They coordinate through a public protocol that users' own callbacks can take part in:
`fusion_period`, `set_run_context` and `state_dict`/`load_state_dict` methods, and the
model's `RunContext` (`run_context(model)`); see `keras_accel.adapter.protocol`.

`chief_only(callback)` makes any other callback (an experiment tracker's logger) act on
the chief process alone; docs/trackers.md.

Modules: `backup` (`BackupAndRestore`, a Keras-facing shell over the backups of
`keras_accel.state`), `checkpoint`, `chief` (`chief_only`), `history`, `learning_rate`;
and, for them alone, `_lock` (the lock file that keeps two runs out of one backup
directory), `_preemption` (a SIGTERM becomes a last backup), `_fits` (which fit holds each
backup directory), `_resume` (where a restore puts a fit), `_callback_states` (the other
callbacks' states in a backup), `_saving` (Keras model files written atomically, anywhere)
and `_run` (the one fact two callbacks pass each other).
"""

from keras_accel.adapter.protocol import RunContext, run_context
from keras_accel.callbacks._preemption import Preempted
from keras_accel.callbacks.backup import BackupAndRestore
from keras_accel.callbacks.checkpoint import ModelCheckpoint
from keras_accel.callbacks.chief import chief_only
from keras_accel.callbacks.history import History
from keras_accel.callbacks.learning_rate import LearningRateScheduler

__all__ = [
    "BackupAndRestore",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "Preempted",
    "RunContext",
    "chief_only",
    "run_context",
]
