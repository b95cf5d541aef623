"""The steps of `keras_accel.loop`: one module per backend behind one contract.

One module each for jax, tensorflow and torch.

Each module defines `Steps(loop)`, whose instance answers:

- `distributed(batches, training)`: an iterable of batches placed for the steps (JAX: arrays
  laid out over the mesh; TensorFlow: a distributed tf.data pipeline, built once per data
  and following the batches' epoch; torch: this process's rows as tensors), the user's
  sample weights (0 on padding rows) and the
  row mask beside them (`keras_accel.data.batching.pack`);
- `train(batch)`, `test(batch)`, `predict(batch)`: one step each, compiled on JAX and
  TensorFlow and traced once per batch shape (`traces` counts them by kind), eager on torch;
- `groups(batches, training, n)`, `train_group(group)`, `test_group(group)`: N steps per
  host call (`steps_per_execution`), and `predict_masked(batch)`;
- `sync()`, `metrics_reset()`, `to_host(outputs)`; torch adds `reading()`, within which
  metric results are every process's.

A step is a pure function of an explicit state on JAX (`(state, batch) -> state`), one
`tf.function` around `strategy.run` on TensorFlow, and Python on torch, as Keras's torch
trainer runs it (each process its rows; the gradients averaged over the process group), so
that a host loop can run N of them per call without changing their bodies.
"""
