"""One custom training loop for JAX, TensorFlow and torch: the user writes the loop,
keras_accel compiles the step (torch runs it eagerly, as Keras's torch trainer does).

The first seed's custom loop is TensorFlow-only: `tf.data` batched per replica, a
`@tf.function` step run by `strategy.run`, a loss averaged with
`tf.nn.compute_average_loss(per_example_loss, global_batch_size=...)`, metrics built in the
strategy's scope. In Keras 3 the same loop must be written again for JAX (`stateless_call`,
`jax.value_and_grad`, `jax.jit` with shardings) and for torch (`backward`, a gradient
all-reduce over `torch.distributed`). `Accelerator.loop` gives one loop for all three:

>>> import keras, numpy as np
>>> from keras_accel import Accelerator
>>> acc = Accelerator(seed=0)
>>> with acc.scope():  # the model and its optimizer live on the Accelerator's devices
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
...     optimizer = keras.optimizers.SGD(0.1)
>>> loop = acc.loop(
...     model,
...     optimizer=optimizer,
...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
...     metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
... )
>>> x, y = np.random.rand(50, 4).astype("float32"), np.random.randint(0, 3, 50)
>>> for epoch in range(2):
...     loop.reset_metrics()
...     for batch in loop.batches(x, y, batch_size=16, shuffle=True, epoch=epoch):
...         loop.train_step(batch)
...     logs = loop.results()                   # plain Python floats
>>> sorted(logs)
['accuracy', 'loss']
>>> loop.predict(x, batch_size=16).shape     # exactly one row per input row
(50, 3)

What the loop guarantees:

- **The loss is the global batch's mean**, as `compute_average_loss` computes it: the sum of
  the (weighted) per-example losses over the real rows of the whole global batch, divided by
  their number. Results do not depend on the replica count, and padding rows (the
  Accelerator's static batches) count nowhere. A Keras `Loss` object is used unreduced (its
  `call`); a plain function must return per-example losses.
- **Metrics over every replica's rows**: the loss tracker and the metrics given are updated
  with the row mask (`weighted_metrics` with the sample weights too), and `results()` reads
  them across replicas.
- **Keras optimizers as they are**: gradient clipping (`clipnorm`, `global_clipnorm`: of the
  global gradient, on every backend), gradient accumulation, and loss scaling under
  `mixed_precision="float16"` (the optimizer is wrapped in Keras's `LossScaleOptimizer`).
- **Static shapes**: `batches()` are the Accelerator's padded batches of one shape, so the
  step compiles once; `evaluate` and `predict` are exact.
- **No trace**: what the step needs on the model (BatchNormalization over real rows) is
  installed for the duration of each call only.

The package, one job per module:

- `custom_loop`: `CustomLoop`, the loop itself (batches, steps, results, whole passes,
  callbacks);
- `batches`: `LoopBatches` (one epoch of batches placed for the steps) and `StepGroup`;
- `arguments`: the optimizer, loss and metrics a loop is built from, resolved as `compile`
  resolves them;
- `losses`: the loss rule, `per_example_losses`;
- `metrics`: the metric updates of a batch, `metric_updates` and `update_metrics`;
- `weights`: how sample weights fit the values they weigh, shared by the two above;
- `backends`: the compiled steps, one small module per backend, each a pure step function
  over an explicit state, which is what running N of them per host call (host-loop fusion)
  needs.
"""

from keras_accel.loop.batches import LoopBatches, StepGroup  # noqa: F401
from keras_accel.loop.custom_loop import CustomLoop

# Importable from here as before, outside `__all__`: the batches' type, and the loss and
# metric rules every backend's step applies.
from keras_accel.loop.losses import per_example_losses  # noqa: F401
from keras_accel.loop.metrics import metric_updates, update_metrics  # noqa: F401

__all__ = ["CustomLoop", "StepGroup"]
