"""One module per Keras backend, each with the same small contract, imported lazily.

`jax` (device meshes), `tensorflow` (a package: tf.distribute strategies) and `torch` (a
package: one process per device over torch.distributed).

Every backend module defines:

- `inventory(probe_tpu=True) -> dict[str, list[str]]`: visible devices by platform ("tpu",
  "gpu", "cpu");
- `build(plan, layout_map=None) -> Runtime`: the runtime for a `Plan`, an instance of the
  class the strategy registry hands back for (this backend, the plan's strategy), around
  the object the registry's builder for them makes
  (`keras_accel.adapter.strategies.STRATEGIES`; each backend registers its builders and
  runtime classes when it is imported, one module per strategy that behaves otherwise
  than the backend's base runtime);
- `backend_versions()`, and where several processes need it `connect(cluster)`,
  `agree_seed(seed)` and `agree_all(flag)`;

and its base `Runtime` subclasses `keras_accel.adapter.runtime.Runtime`, the contract the
core calls (scope, the misplacement checks, what one call installs, row counts, `wrap`).

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
