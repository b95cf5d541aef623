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

`keras_accel.callbacks.BackupAndRestore` is the user-facing side; see docs/callbacks.md.
"""
