"""Importing keras_accel pulls in only the active backend (simulated single-backend installs)."""

import os
import subprocess
import sys

import pytest

# A package missing as Python sees one: `import` raises ModuleNotFoundError and
# importlib.util.find_spec returns None (torch._dynamo probes for tensorflow that way, and an
# import hook that raises instead would break it).
BLOCK = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
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


# Each backend's install may lack the other two (torch included: its extra is optional).
@pytest.mark.parametrize(
    "backend,blocked",
    [
        ("jax", ("tensorflow", "torch")),
        ("tensorflow", ("jax", "torch")),
        pytest.param("torch", ("jax", "tensorflow"), marks=pytest.mark.torch),
    ],
)
def test_runs_without_the_other_backends_installed(backend, blocked):
    env = dict(os.environ, KERAS_BACKEND=backend)
    code = BLOCK.format(blocked=set(blocked)) + RUN
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout
