"""KERAS_BACKEND=torch, two processes (`keras-accel launch -n 2`): where the model's own code
weights no rows (a custom `train_step` and `test_step`, `add_loss`), the last partial batch
runs whole in every process (`remainder="replicate"`), and training, validation and
evaluation report and train as plain Keras in one process, nothing dropped or refused
(tests/adapter/_torch_replicated.py; one process and JAX: test_custom_step_padding.py,
test_unweighted.py)."""

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

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_replicated.py")


def launch(script, out, *args, backend="torch"):
    """Runs `script OUT ARGS` in two processes of `backend`; every process's OUT-<process>.npz
    and what they printed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND=backend)
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    run = subprocess.run(
        [*command, script, str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [dict(np.load(f"{out}-{index}.npz")) for index in (0, 1)], run.stdout + run.stderr


def compare(saved, prefix):
    """Every "<prefix>.../ours" against its ".../one": what plain Keras gave in one process."""
    keys = [k for k in saved if k.startswith(prefix) and k.endswith("/ours")]
    assert keys
    for key in keys:
        np.testing.assert_allclose(
            saved[key], saved[key[: -len("ours")] + "one"], rtol=1e-5, atol=1e-6, err_msg=key
        )
    return keys


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    return launch(SCRIPT, tmp_path_factory.mktemp("torch-replicated") / "two")


@pytest.mark.parametrize("case", ["custom", "compiled", "generator", "pydataset"])
def test_the_last_partial_batch_runs_whole_in_every_process_as_one_process_runs_it(processes, case):
    saved, output = processes
    for process in saved:
        keys = compare(process, f"{case}/")
        validated = case in ("custom", "compiled")
        assert any(".val_" in key for key in keys) == validated
        assert any("evaluate." in key for key in keys)
    assert "runs unpadded" in output and "is dropped" not in output
