"""One module per Keras backend, each with the same small contract, imported lazily.

Every backend module defines:

- `inventory(probe_tpu=True) -> dict[str, list[str]]`: visible devices by platform ("tpu",
  "gpu", "cpu");
- `build(plan, layout_map=None) -> Runtime`: the distribution for a `Plan`;

and its `Runtime` answers:

- `scope()`, `num_replicas`, `native` (the `keras.distribution` object or `tf.distribute`
  strategy, None for one device);
- `model_misplaced(model)` and `variable_misplaced(variable)`: why a model or a variable
  was not made under this runtime (None when it was), for the "built outside the scope"
  errors;
- `install(patches, model, first_batch, training)`: what this backend changes for the
  duration of one Accelerator call (`keras_accel.adapter.patches`);
- `all_reduce_sum` (sums BatchNormalization moments across replicas, or None where the
  program sees the global batch) and `row_count(row_mask)` (a batch's real rows, as the
  weight of its loss in the epoch average);
- `wrap(batches, carry_mask, preprocess)`: what `model.fit` takes.

Importing this package imports no backend; `load()` imports exactly the one asked for, so a
JAX-only install never imports TensorFlow.
"""

from __future__ import annotations

import importlib

SUPPORTED_BACKENDS = ("jax", "tensorflow", "torch")


def load(name: str):
    """The backend module for a Keras backend name."""
    if name not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"keras_accel supports KERAS_BACKEND in {SUPPORTED_BACKENDS}. Received: "
            f"KERAS_BACKEND={name!r}. Set KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow."
        )
    return importlib.import_module(f"keras_accel.adapter.backends.{name}")
