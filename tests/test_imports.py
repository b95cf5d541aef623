"""Importing keras_accel pulls in only the active backend (simulated single-backend installs)."""

import os
import subprocess
import sys

import pytest

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {blocked!r} or name.startswith({blocked!r} + "."):
            raise ImportError("blocked for this test: " + name)
sys.meta_path.insert(0, Block())
"""

RUN = """
import numpy as np, keras
import keras_accel
from keras_accel import Accelerator
acc = Accelerator()
with acc.scope():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
acc.fit(model, np.ones((10, 3), "float32"), np.zeros((10, 2), "float32"), batch_size=4,
        verbose=0)
print("OK", acc.strategy_name)
"""


@pytest.mark.parametrize("backend,blocked", [("jax", "tensorflow"), ("tensorflow", "jax")])
def test_runs_without_the_other_backend_installed(backend, blocked):
    env = dict(os.environ, KERAS_BACKEND=backend)
    code = BLOCK.format(blocked=blocked) + RUN
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout
