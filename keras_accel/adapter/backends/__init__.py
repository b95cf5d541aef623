"""One module per Keras backend, each with the same small contract, imported lazily.

Every backend module defines:

- `inventory() -> dict[str, list[str]]`: visible devices by platform ("tpu", "gpu", "cpu");
- `build(plan, layout_map=None) -> Runtime`: the distribution for a `Plan`;

and its `Runtime` answers `scope()`, `num_replicas`, `native` (the `keras.distribution` object
or `tf.distribute` strategy), `check_model(model)`, `all_reduce_sum` (for BatchNormalization
statistics, or None) and `wrap(batches)` (what `model.fit` takes).

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
