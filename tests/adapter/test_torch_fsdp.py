"""`strategy="fsdp"` on torch: 2 processes (`keras-accel launch -n 2`), each holding half of
every variable and optimizer slot that the process count divides (FSDP2, DTensor), train,
evaluate and predict as one process on the global batch, on uneven data
(tests/adapter/_torch_fsdp.py: 37 rows in batches of 8, SGD with momentum and Adam,
BatchNormalization, Dropout, validation inside the fit), and leave the model whole and plain after
each call."""

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import BACKEND

# The processes are torch's whatever the run's backend: on the torch run only (the JAX and
# TensorFlow runs started the same three processes again, 67 s each beside the suite).
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="torch's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_fsdp.py")
TIMEOUT_S = 300
TOLERANCE = 1e-5  # Two processes' gradient sums in another order: float rounding.


def _run(command):
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    return subprocess.run(
        command,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-fsdp")
    one = _run([sys.executable, SCRIPT, str(work / "one"), "single"])
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, SCRIPT, str(work / "two"), "fsdp"])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    def load(name):
        with np.load(work / f"{name}.npz") as f:
            return dict(f)

    return load("one-0"), load("two-0"), load("two-1")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_fsdp_processes_train_evaluate_and_predict_as_one(runs, optimizer):
    one, first, second = runs
    keys = sorted(k for k in one if k.startswith(f"{optimizer}/") and "/held/" not in k)
    names = ("loss", "val_loss", "w0", "slot0", "evaluate", "predict")
    assert {f"{optimizer}/{n}" for n in names} <= set(keys)
    assert first[f"{optimizer}/predict"].shape == (37, 3)  # Every row, in order.
    for key in keys:
        if one[key].dtype.kind == "U":
            continue
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    assert np.abs(one[f"{optimizer}/loss"][0] - one[f"{optimizer}/loss"][1]) > 1e-3  # It trained.


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_each_process_holds_half_of_what_two_divide_between_steps(runs, optimizer):
    """JAX's rule: the largest dimension the process count divides is split; BatchNormal-
    ization's moving statistics (written inside the forward pass) and a (3,) bias stay
    whole. The slots are split as their variables."""
    one, first, second = runs
    held = {
        k.split("/held/")[1]: tuple(first[k]) for k in first if k.startswith(f"{optimizer}/held/")
    }
    whole = {k.split("/held/")[1]: tuple(one[k]) for k in one if k.startswith(f"{optimizer}/held/")}
    assert held.keys() == whole.keys() and len(held) == 10 + (8 if optimizer == "sgd" else 16)
    for key, shape in whole.items():
        if key.endswith(("moving_mean", "moving_variance")) or shape == (3,):
            assert held[key] == shape, key
        else:
            assert np.prod(held[key]) * 2 == np.prod(shape), (key, held[key], shape)
    by_shape = {whole[k]: held[k] for k in held if k.startswith("var/")}
    assert by_shape[(6, 8)] == (6, 4) and by_shape[(6, 3)] == (3, 3)  # The largest divided.
    for key in held:  # The second process holds the other half.
        assert tuple(second[f"{optimizer}/held/{key}"]) == held[key]
    # After the call the model is Keras's own again: plain variables, whole weights.
    assert str(first[f"{optimizer}/class"]) == str(one[f"{optimizer}/class"]) == "Variable"


def test_a_callback_reading_split_weights_inside_the_call_is_refused_in_our_words(runs):
    one, first, second = runs
    assert str(one["checkpoint"]) == "saved"
    for run in (first, second):
        assert "is split over the processes during this call" in str(run["checkpoint"])
        assert "model.get_weights()" in str(run["checkpoint"])
        assert run["after_checkpoint"].shape == (6, 8)  # The model whole again.
