"""KERAS_BACKEND=torch: one process per device, for real (gloo processes on localhost).

Two processes (`keras-accel launch -n 2`) against one process on the global batch, from
every input kind (tests/adapter/_torch_inputs.py): 45 rows in batches of 8, so the last
batch is padded and splits unevenly over the processes; BatchNormalization; SGD with
momentum. Both processes must hold the same numbers, bit for bit; against one process the
only difference is the order of the gradient's sum (one matmul over 8 rows there, two over
4 and an all-reduce here): measured <= 2.4e-7 on these weights and logs, so 1e-5.
"""

import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_inputs.py")
TIMEOUT_S = 300
TOLERANCE = 1e-5
INPUTS = ("arrays", "generator", "pydataset", "tfdata", "dataloader")


def _env(**extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch", **extra)
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    return env


def _run(command, **extra):
    result = subprocess.run(
        command,
        env=_env(**extra),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("torch-inputs")
    one = _run([sys.executable, SCRIPT, str(work / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, SCRIPT, str(work / "two")])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    def load(name):
        with np.load(work / f"{name}.npz") as f:
            return dict(f)

    return load("one-0"), load("two-0"), load("two-1")


@pytest.mark.parametrize("kind", INPUTS)
def test_two_processes_train_as_one_on_uneven_data(runs, kind):
    one, first, second = runs
    keys = sorted(k for k in one if k.startswith(f"{kind}/"))
    assert f"{kind}/loss" in keys and f"{kind}/w0" in keys
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    if kind == "arrays":  # The weights moved: a run that trained nothing would match too.
        assert np.abs(one["arrays/w0"] - one["pydataset/w0"]).max() > 1e-3


def test_evaluate_and_predict_are_exact_and_whole(runs):
    one, first, second = runs
    for kind in ("arrays", "dataloader"):
        assert first[f"{kind}/predict"].shape == (45, 3)  # Every row, on every process.
        for name in ("evaluate", "predict"):
            key = f"{kind}/{name}"
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
            np.testing.assert_allclose(first[key], one[key], rtol=0, atol=TOLERANCE, err_msg=key)
    assert int(first["recompiles"]) == 0 and int(one["recompiles"]) == 0


def test_the_backward_pass_sends_the_gradients_in_buckets(runs):
    """Every bucket of every step is sent by the backward pass itself (none is left to the
    optimizer's apply): buckets close once they pass 64 bytes, so the 6 weights, last first,
    make 3 ([bias, kernel] of the last Dense, BatchNormalization's [beta, gamma], the first
    Dense's); 4 of the 5 fits train 2 epochs of 6 steps and the generator's 1 epoch; one
    process has no group to send to."""
    one, first, second = runs
    assert int(first["sent_early"]) == int(second["sent_early"]) == 3 * (4 * 12 + 6)
    assert int(one["sent_early"]) == 0
    assert not bool(first["ddp_wrapped"])  # Keras 3.16's own DDP would reduce them again.


PRECISION_SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_precision.py")


def test_float16_loss_scaling_decides_alike_in_every_process(tmp_path):
    """Under "float16" (Keras's LossScaleOptimizer) both processes hold the same weights,
    bit for bit: the skip-or-apply decision reads the averaged gradients. Against one
    process, float16's own rounding in another order: measured 1.3e-4 on the weights' sum,
    so 2e-3."""
    one = _run([sys.executable, PRECISION_SCRIPT, "float16", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    two = _run([*launch, PRECISION_SCRIPT, "float16", str(tmp_path / "two")])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    loaded = [dict(np.load(tmp_path / f"{n}.npz")) for n in ("one-0", "two-0", "two-1")]
    reference, first, second = loaded
    assert str(first["optimizer"]) == "LossScaleOptimizer"
    for key in first:
        if key != "optimizer":
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
            np.testing.assert_allclose(first[key], reference[key], atol=2e-3, err_msg=key)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOIN = "from keras_accel import Accelerator; Accelerator()"


def test_a_rank_that_never_joins_fails_within_the_timeout():
    started = time.monotonic()
    result = _run(
        [sys.executable, "-c", JOIN],
        WORLD_SIZE="2",
        RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        KERAS_ACCEL_HEARTBEAT_TIMEOUT="5",
    )
    assert result.returncode != 0
    assert "waited 5 s for all 2 processes to join" in result.stderr
    assert time.monotonic() - started < 120


def test_a_port_in_use_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(
            [sys.executable, "-c", JOIN],
            WORLD_SIZE="2",
            RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            KERAS_ACCEL_HEARTBEAT_TIMEOUT="30",
        )
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "in use by another program" in result.stderr


def test_a_bad_world_size_is_named():
    result = _run([sys.executable, "-c", JOIN], WORLD_SIZE="2", RANK="2")
    assert result.returncode != 0
    assert "needs this process's RANK in [0, 2). Received: RANK='2'" in result.stderr


def _model(acc):
    with acc.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    return model


def test_one_process_runs_one_step_per_call():
    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    assert (acc.strategy_name, acc.num_replicas, acc.num_processes) == ("single", 1, 1)
    model = _model(acc)
    x, y = np.ones((10, 4), "float32"), np.ones((10, 2), "float32")
    history = acc.fit(model, x, y, batch_size=4, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2 and model.steps_per_execution == 1
    with pytest.raises(ValueError, match=r"at most 1 step per call. Received: Accelerator"):
        Accelerator(steps_per_execution=4).fit(_model(acc), x, y, verbose=0)


def test_data_parallel_needs_one_process_per_device():
    from keras_accel import Accelerator

    with pytest.raises(ValueError, match="devices=2 but 1 cpu devices exist"):
        Accelerator(strategy="data_parallel", devices=2)
