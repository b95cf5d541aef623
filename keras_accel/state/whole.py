"""`whole_values(model)`: a model's variables read whole on every process, for Keras's savers.

Under several JAX processes a variable sharded over a mesh that spans them (`fsdp`,
`model_parallel` across hosts) is a `jax.Array` no single process can read: Keras's
`model.save(...)` and `model.save_weights(...)` convert each variable with `np.array`, which
raises "Fetching value for `jax.Array` that spans non-addressable ... devices is not
possible". Inside `whole_values(model)` each such variable (the model's, its optimizer's and
its metrics') reads as its whole value, gathered into host memory on every process
(`process_allgather`, a collective: every process enters the block, in the same order). When
the block ends each variable holds again the very array it held, in its layout: nothing of
the gather is left. (Not `keras.StatelessScope`: Keras's savers make an optimizer of their
own, and a scope refuses to create its variables.)

The cost is one whole copy of those variables in each process's host memory while the block
runs, never on a device. For a model whose state does not fit a host, save sharded state
instead: `keras_accel.callbacks.BackupAndRestore` writes each device's shards as they lie
(Orbax) and restores onto any layout.

Everywhere else (one process, TensorFlow, a mesh within each process) every variable is
readable as it is, and the block changes nothing.

Example (every process runs it; only the chief writes to the shared path):

>>> import keras, numpy as np
>>> from keras_accel.state.whole import whole_values
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> with whole_values(model):
...     np.array(model.weights[0]).shape
(2, 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

from keras_accel.state import tree
from keras_accel.utils import keras_internals


def _unreadable(variable) -> bool:
    """Whether this process cannot read the variable's array whole (it spans devices of
    other processes and is split over them)."""
    value = variable.value
    return not (
        getattr(value, "is_fully_addressable", True) or getattr(value, "is_fully_replicated", True)
    )


@contextlib.contextmanager
def whole_values(model) -> Iterator[None]:
    """Within the block, every variable of `model` (and of its optimizer and metrics) that
    this process cannot read whole reads as its whole value, gathered on the host.

    A collective under several JAX processes: every process must enter it, for the same
    model. Elsewhere it does nothing.
    """
    if keras.backend.backend() != "jax":
        yield
        return
    import jax

    if jax.process_count() == 1:
        yield
        return
    from jax.experimental import multihost_utils

    # Every process finds the same variables in the same order (the same model on each):
    # the gathers below pair up across processes.
    split = [v for v in tree.variables(model).values() if _unreadable(v)]
    if not split:
        yield
        return
    gathered = [multihost_utils.process_allgather(v.value, tiled=True) for v in split]
    held = []  # (variable, its layout, its array), to put back as they were.
    try:
        # On the host's own CPU device: the whole values never go to an accelerator. With
        # no layout, an assignment keeps the array it is given instead of laying it out
        # over the mesh again (which would split it again).
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            for variable, value in zip(split, gathered):
                held.append((variable, keras_internals.variable_layout(variable), variable.value))
                keras_internals.set_variable_layout(variable, None)
                variable.assign(value)
        yield
    finally:
        for variable, layout, array in reversed(held):
            variable.assign(array)  # Still without a layout: the same array, as it lay.
            keras_internals.set_variable_layout(variable, layout)
