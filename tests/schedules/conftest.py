"""Fixtures for the schedule tests: evaluate a schedule eagerly or compiled by the backend."""

import sys

import keras
import numpy as np
import pytest
from keras import ops

BACKEND = keras.backend.backend()


def _compile(fn):
    """`fn` under the backend's compiler: `jax.jit` on JAX, `tf.function` on TensorFlow."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    pytest.skip(f"no compiled check for backend {BACKEND!r}")


@pytest.fixture(autouse=True)
def _no_tensorflow_in_jax_runs(monkeypatch):
    """On JAX, make `import tensorflow` fail for the duration of each schedule test.

    Keras's serializer probes `tf.available` to look for `tf.TensorShape`, which imports
    TensorFlow whenever it is installed; blocking it proves the schedules, their configs and
    `model.save` need no TensorFlow in a JAX run (and keeps TF's env vars out of the run).
    """
    if BACKEND == "jax" and "tensorflow" not in sys.modules:
        from keras.src.utils import module_utils

        monkeypatch.setitem(sys.modules, "tensorflow", None)
        monkeypatch.setattr(module_utils.tensorflow, "_available", False)
    yield


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Overrides the suite-wide reset with the same resets minus the garbage collection.

    The schedule tests are a hundred tiny evaluations; a full `gc.collect()` after each one
    cost more than the tests themselves. Keras's global state is still cleared every time.
    """
    yield
    from keras import distribution

    if BACKEND == "jax":
        distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session(free_memory=False)


@pytest.fixture(params=["eager", "compiled"])
def evaluate(request):
    """`evaluate(fn, steps)`: `fn` on an int32 array of steps, as a NumPy array.

    Parametrized so that each test runs once eagerly and once inside the backend's compiled
    function, where the step is a tracer rather than a concrete number.
    """

    def run(fn, steps):
        steps = np.asarray(steps, dtype="int32")
        if request.param == "compiled":
            return ops.convert_to_numpy(_compile(lambda s: fn(s))(ops.convert_to_tensor(steps)))
        return ops.convert_to_numpy(fn(steps))

    return run
