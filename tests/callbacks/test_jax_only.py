"""On a JAX-only install the callbacks and keras_accel.state.files never import TensorFlow."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

CODE = """
import importlib.util
import sys


def blocked(name):
    return name == "tensorflow" or name.startswith("tensorflow.")


class Block:
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ImportError("blocked for this test: " + name)


sys.meta_path.insert(0, Block())
# Libraries that only ask whether TensorFlow is installed (etils, under Orbax) get the answer
# of a JAX-only install, None, instead of the import error above.
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if blocked(name) else _find_spec(name, package)
)
import os, tempfile
import numpy as np, keras
from keras_accel import Accelerator
from keras_accel.callbacks import BackupAndRestore, History, LearningRateScheduler, ModelCheckpoint

folder = tempfile.mkdtemp()
acc = Accelerator(seed=0)
with acc.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
callbacks = [
    LearningRateScheduler(lambda step: 0.01, update_freq="step"),
    History(path="memory://jax-only/history.json", csv=True, per_step=True),
    ModelCheckpoint(os.path.join(folder, "m.keras")),
    ModelCheckpoint("memory://jax-only/m.weights.h5", save_weights_only=True),
    BackupAndRestore(os.path.join(folder, "backup"), save_freq=1),
]
acc.fit(model, np.ones((10, 3), "float32"), np.zeros((10, 2), "float32"), batch_size=4,
        epochs=2, verbose=0, callbacks=callbacks)
assert "tensorflow" not in sys.modules
print("OK")
"""


def test_callbacks_run_without_tensorflow(backend):
    if backend != "jax":
        pytest.skip("a JAX-only install is simulated on the JAX run")
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout
