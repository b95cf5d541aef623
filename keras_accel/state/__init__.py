"""Training state on the engines the field uses: Orbax on JAX, tf.train on TensorFlow, DCP
(`torch.distributed.checkpoint`) on torch.

- `keras_accel.state.tree`: the variables that define where training is, keyed by path;
- `keras_accel.state.engines`: one module per engine behind one small contract, imported
  lazily (a JAX run never imports TensorFlow or torch);
- `keras_accel.state.files`: every other file keras_accel writes, through fsspec;
- `keras_accel.state.checksums`: each backup file's size and CRC32C, recorded at its commit
  and checked before a restore;
- `keras_accel.state.keras_writers`: Keras's own file-writing callbacks, the chief's files
  only over several processes.

The backups of `keras_accel.callbacks.BackupAndRestore`, which is their Keras-facing shell
(docs/callbacks.md), each part in its own module:

- `keras_accel.state.schedule`: when a backup is due, and its number;
- `keras_accel.state.backups`: one directory's backups on its engine: save, wait, list,
  delete;
- `keras_accel.state.record`: the JSON record each backup commits with its arrays;
- `keras_accel.state.recovery`: the newest intact backup restored, damaged ones set aside;
- `keras_accel.state.keras_backups`: resuming from `keras.callbacks.BackupAndRestore`'s files;
- `keras_accel.state.faults`: what a failed write or a damaged backup says, on every engine.
"""
