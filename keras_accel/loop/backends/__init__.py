"""The compiled steps of `keras_accel.loop`: one module per backend behind one contract.

Each module defines `Steps(loop)`, whose instance answers:

- `distributed(batches, training)`: an iterable of batches placed for the steps (JAX: arrays
  laid out over the mesh; TensorFlow: a distributed tf.data pipeline, built once per data
  and following the batches' epoch), the user's sample weights (0 on padding rows) and the
  row mask beside them (`keras_accel.data.batching.pack`);
- `train(batch)`, `test(batch)`, `predict(batch)`: one compiled step each, traced once per
  batch shape (`traces` counts them by kind);
- `sync()`, `metrics_reset()`, `to_host(outputs)`.

A step is a pure function of an explicit state on JAX (`(state, batch) -> state`) and one
`tf.function` around `strategy.run` on TensorFlow, so that a host loop can later run N of
them per call without changing their bodies.
"""
