"""KERAS_BACKEND=torch, two processes for real: batches that grow past the first
(tests/adapter/_torch_growing.py), from a generator, a PyDataset and tf.data. Each process
takes its contiguous share of every bucket; both must hold the same numbers, bit for bit,
and match one process, which matches plain one-device Keras (within the order of a sum's
terms: measured <= 3e-7, so 1e-5)."""

import os
import sys

import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_growing.py")
TOLERANCE = 1e-5
SOURCES = ("generator", "pydataset", "tfdata")


def _run(command):
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-growing")
    one = _run([sys.executable, SCRIPT, str(work / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(
        [
            sys.executable,
            "-m",
            "keras_accel.cli.main",
            "launch",
            "-n",
            "2",
            SCRIPT,
            str(work / "two"),
        ]
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    def load(name):
        with np.load(work / f"{name}.npz") as f:
            return dict(f)

    return load("one-0"), load("two-0"), load("two-1")


@pytest.mark.parametrize("source", SOURCES)
def test_two_processes_on_growing_batches_match_one_and_plain_keras(runs, source):
    one, first, second = runs
    keys = sorted(k for k in one if k.startswith(f"{source}/"))
    assert {f"{source}/{part}" for part in ("loss", "w0", "evaluate", "predict")} <= set(keys)
    assert first[f"{source}/predict"].shape == (25, 2)  # Every row, in order.
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
        np.testing.assert_allclose(
            one[key], one[f"keras/{key}"], rtol=0, atol=TOLERANCE, err_msg=key
        )
