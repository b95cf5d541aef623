"""Test set-up: pick the backend, split the CPU into 8 logical devices (one on torch), keep only
the tests marked `torch` on the torch run, guard the environment."""

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
# Whether a model's steps run compiled is decided by timing them (keras_accel.adapter.choice);
# on a shared machine timing must not decide which way, so which numbers, a test sees: no
# trial unless a test asks (tests/adapter/test_choice.py and the tests of each backend's
# choice set their own threshold, and a decisions file of their own).
os.environ.setdefault("KERAS_ACCEL_JIT_COMPILE_AFTER", "1e9")
os.environ.setdefault("KERAS_ACCEL_JIT_COMPILE_CACHE", "0")

import keras  # noqa: E402
import pytest  # noqa: E402

from keras_accel.utils.devices import configure_virtual_cpu_devices  # noqa: E402

# Local object-store servers (s3://, gs://) as fixtures for every test: s3_bucket, gcs_bucket.
pytest_plugins = ["tests.object_stores"]

BACKEND = keras.backend.backend()

# On torch one process is one device (several are several processes: keras-accel launch -n N),
# so its run has one device whatever KERAS_ACCEL_TEST_DEVICES says elsewhere.
NUM_DEVICES = int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "1" if BACKEND == "torch" else "8"))
if BACKEND == "torch" and NUM_DEVICES != 1:
    raise pytest.UsageError(
        f"KERAS_BACKEND=torch runs one device per process; received "
        f"KERAS_ACCEL_TEST_DEVICES={NUM_DEVICES}. Leave it unset or set it to 1 (the "
        "multi-process tests start their own processes)."
    )
configure_virtual_cpu_devices(NUM_DEVICES)


def pytest_report_header(config):
    if BACKEND == "torch":
        return (
            "KERAS_BACKEND=torch: only tests marked 'torch' are collected, the rest deselected "
            "(tests/conftest.py); one device per process"
        )
    return None


def pytest_collection_modifyitems(config, items):
    """The torch run is the torch-capable tests: those marked `torch`. The JAX and TF runs
    take every test (the mark only adds the torch run)."""
    if BACKEND != "torch":
        return
    kept = [item for item in items if item.get_closest_marker("torch") is not None]
    deselected = [item for item in items if item.get_closest_marker("torch") is None]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


# Set by pytest itself, by TensorFlow when first imported (a tf.data test on the JAX run), or
# by torch's compiler the first time it compiles (a compiled torch step).
IMPORT_TIME_VARIABLES = {
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
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
