"""Test set-up: pick the backend, split the CPU into 8 logical devices, guard the environment."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The suite must not depend on this machine's Keras home: a ~/.keras/keras.json naming another
# backend, float16 or channels_first, an empty or read-only cache. Keras reads KERAS_HOME once,
# at import; a fresh one per session (inherited by the subprocesses tests start) makes every
# run see Keras's defaults.
_KERAS_HOME = tempfile.mkdtemp(prefix="keras-accel-tests-home-")
atexit.register(shutil.rmtree, _KERAS_HOME, ignore_errors=True)
os.environ["KERAS_HOME"] = _KERAS_HOME

import keras  # noqa: E402
import pytest  # noqa: E402

from keras_accel.utils.devices import configure_virtual_cpu_devices  # noqa: E402

NUM_DEVICES = int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8"))
configure_virtual_cpu_devices(NUM_DEVICES)

BACKEND = keras.backend.backend()


# Set by pytest itself, or by TensorFlow when first imported (a tf.data test on the JAX run).
IMPORT_TIME_VARIABLES = {
    "PYTEST_CURRENT_TEST",
    "TF2_BEHAVIOR",
    "TPU_ML_PLATFORM",
    "TPU_ML_PLATFORM_VERSION",
    "ENABLE_RUNTIME_UPTIME_TELEMETRY",
    "HDF5_PLUGIN_PATH",
}


@pytest.fixture(autouse=True)
def _no_leaked_env():
    """Fail a test that leaves environment variables changed (Lightning's guard)."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    changed -= IMPORT_TIME_VARIABLES
    if changed:
        os.environ.clear()
        os.environ.update(before)
        pytest.fail(f"test leaked environment variables: {sorted(changed)}")


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Each test starts from a clean Keras session: no global distribution, float32 policy."""
    yield
    from keras import distribution

    if BACKEND == "jax":
        distribution.set_distribution(None)
    keras.config.set_dtype_policy("float32")
    # free_memory=False: a full gc.collect() per test costs tens of seconds under TF.
    keras.backend.clear_session(free_memory=False)


@pytest.fixture
def num_devices():
    return NUM_DEVICES


@pytest.fixture
def backend():
    return BACKEND
