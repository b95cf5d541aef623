"""KERAS_BACKEND=torch, two processes (`keras-accel launch -n 2`): keras-io's models whose
own code computes the loss (a class's `compute_loss`, a layer's `add_loss`) and an
Embedding on `ops.arange` train and report as plain Keras on one process
(tests/adapter/_torch_losses.py; TensorFlow and JAX: test_losses_and_gradients.py)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_losses.py")


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-losses")
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    run = subprocess.run(
        [*launch, SCRIPT, str(work / "two")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [dict(np.load(work / f"two-{index}.npz")) for index in (0, 1)]


@pytest.mark.parametrize("name", ["distiller", "endpoint", "embedding"])
def test_two_processes_report_and_train_as_one(processes, name):
    for logs in processes:
        keys = [k for k in logs if k.startswith(f"{name}/") and k.count("/") == 1]
        assert f"{name}/loss" in keys
        for key in keys:
            if key.endswith("/weights"):
                assert float(logs[key]) < 1e-5, key
            else:
                np.testing.assert_allclose(logs[key], logs[f"{key}/one"], rtol=1e-5, err_msg=key)
