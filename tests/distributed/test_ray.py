"""Ray Train runs a keras_accel script unchanged, on a real local Ray cluster: TorchTrainer and
TensorflowTrainer with 2 workers end as one process does; JaxTrainer (1 worker: on CPUs Ray
joins no JAX cluster) too. A worker SIGKILLed mid-epoch with `FailureConfig(max_failures=1)`
is restarted by Ray, and BackupAndRestore resumes the run to the uninterrupted one's weights,
bit for bit.

Not part of the default run (Ray is no dependency of keras_accel, and the three trainers take
about 5 minutes here): with Ray installed,

    pip install -c constraints.txt "ray[train]==2.60.0"
    KERAS_ACCEL_TEST_RAY=1 python -m pytest -q -m ray tests/distributed/test_ray.py
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        not os.environ.get("KERAS_ACCEL_TEST_RAY"),
        reason="Ray's tests run on their own: KERAS_ACCEL_TEST_RAY=1 python -m pytest -m ray "
        "tests/distributed/test_ray.py (docs/development.md)",
    ),
]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 900  # Two Ray runs, one restarted; about 100 s each trainer here.
# 2 processes against one: the gradient's rows summed in two halves (torch's gloo, TensorFlow's
# ring all-reduce), measured within 1e-7 here; one JAX worker is one process, exactly.
TOLERANCE = {"torch": 1e-5, "tensorflow": 1e-5, "jax": 0.0}


def _weights(workdir):
    with np.load(os.path.join(workdir, "weights-0.npz")) as f:
        return {key: f[key] for key in f.files}


def _env(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    # The checkout first, as for the test itself (a Ray installed beside keras_accel's
    # environment may not see its editable install).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("trainer", ["torch", "tensorflow", "jax"])
def test_a_ray_run_equals_one_process_and_a_killed_worker_resumes_exactly(trainer, tmp_path):
    if importlib.util.find_spec("ray") is None:  # Not imported here: the driver runs Ray.
        pytest.skip("Ray Train is not installed: pip install -c constraints.txt 'ray[train]'")
    one = tmp_path / "one"
    one.mkdir()
    alone = subprocess.run(
        [sys.executable, os.path.join(HERE, "_ray_train.py"), str(one)],
        env=_env(trainer),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    driver = subprocess.run(
        [sys.executable, os.path.join(HERE, "_ray_driver.py"), trainer, str(tmp_path)],
        env=_env(trainer),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    assert json.loads(driver.stdout.strip().splitlines()[-1]) == {
        "straight": None,
        "killed": None,
    }

    reference, straight = _weights(one), _weights(tmp_path / "straight")
    killed = _weights(tmp_path / "killed")
    processes = 1 if trainer == "jax" else 2
    assert int(straight["processes"]) == processes and int(reference["processes"]) == 1
    for key in reference:
        if key.startswith("arr_"):
            np.testing.assert_allclose(
                straight[key], reference[key], rtol=0, atol=TOLERANCE[trainer], err_msg=key
            )
    # The worker really died (its marker), Ray restarted the group, and the run resumed.
    assert (tmp_path / "killed" / "killed").exists()
    assert not (tmp_path / "straight" / "killed").exists()
    assert int(killed["iterations"]) == int(straight["iterations"]) == 18
    for key in straight:
        np.testing.assert_array_equal(killed[key], straight[key], err_msg=key)
    # Trained to the end: every backup deleted, as BackupAndRestore does by default.
    assert not (tmp_path / "killed" / "backup").exists()
