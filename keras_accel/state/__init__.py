"""Training state on the engines the field uses: Orbax on JAX, tf.train on TensorFlow, DCP
(`torch.distributed.checkpoint`) on torch.

- `keras_accel.state.tree`: the variables that define where training is, keyed by path;
- `keras_accel.state.engines`: one module per engine behind one small contract, imported
  lazily (a JAX run never imports TensorFlow or torch);
- `keras_accel.state.files`: every other file keras_accel writes, through fsspec.

`keras_accel.callbacks.BackupAndRestore` is the user-facing side; see docs/callbacks.md.
"""
