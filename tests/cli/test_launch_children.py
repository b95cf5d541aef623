"""`keras-accel launch`: what its processes get and what it prints of them. The failure
naming and the start-up noise are checked on real multi-process runs (torch gloo, JAX's CPU
collectives) where the backend is the one under test; the rest with plain Python children."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from keras_accel.cli.launch import OutputFilter, child_defaults, is_installed
from tests.cli._shims import pythonpath_without_torch
from tests.conftest import BACKEND

TIMEOUT_S = 300  # A hang fails the test instead of stalling the suite.


def _launch(tmp_path, body, *options, **env):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", *options, str(script)]
    environ = dict(os.environ, PYTHONUNBUFFERED="1")
    environ.pop("KERAS_ACCEL_TEST_DEVICES", None)
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return subprocess.run(
        command,
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


# One process raises in the middle of a fit; the other then dies of the broken collective
# (gloo's "Connection closed by peer"), after the first one's traceback, often in the same poll.
RAISE_IN = """
    import os

    import keras
    import numpy as np
    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    RAISER = int(os.environ["RAISER"])

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if acc.process_index == RAISER and batch == 3:
                raise ValueError(f"boom in process {RAISER}")

    with acc.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    x, y = np.ones((400, 4), "float32"), np.ones((400, 2), "float32")
    acc.fit(model, x, y, batch_size=8, epochs=3, verbose=0, callbacks=[Boom()])
    print("finished")
"""


def _assert_the_raiser_is_named(result, raiser):
    out, err = result.stdout, result.stderr
    peer = 1 - raiser
    assert result.returncode == 1, out[-3000:] + err[-3000:]
    assert f"ValueError: boom in process {raiser}" in out
    # The peer failed too (the collective), but it is not the cause.
    assert f"failed: process {raiser} (exit code 1)" in err, err
    assert f"process {peer} (pid" not in err and f"failed: process {peer}" not in err, err
    assert "finished" not in out


# Both ways round: the cause is found by when its error came, not by its index.
@pytest.mark.torch
@pytest.mark.skipif(BACKEND != "torch", reason="torch's gloo processes")
@pytest.mark.parametrize("raiser", [1, 0])
def test_the_process_that_raised_is_named_not_the_peer_it_broke_torch(tmp_path, raiser):
    result = _launch(tmp_path, RAISE_IN, "-n", "2", KERAS_BACKEND="torch", RAISER=str(raiser))
    _assert_the_raiser_is_named(result, raiser)
    # The peer failed too: gloo's error (a closed connection, or a reset one) blames the raiser,
    # or, on a loaded machine, the launcher stopped the peer before gloo noticed (exit -15).
    peer_broke = "Check the logs of the remote worker" in result.stdout
    peer_stopped = "exit codes [-15, 1]" in result.stderr or "exit codes [1, -15]" in result.stderr
    assert peer_broke or peer_stopped, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's distributed runtime and CPU collectives")
@pytest.mark.parametrize("raiser", [1, 0])
def test_the_process_that_raised_is_named_not_the_peer_it_broke_jax(tmp_path, raiser):
    result = _launch(tmp_path, RAISE_IN, "-n", "2", KERAS_BACKEND="jax", RAISER=str(raiser))
    _assert_the_raiser_is_named(result, raiser)
    # jaxlib's "[Gloo] Rank r is connected to 1 peer ranks" lines (all peers there) are left
    # out; the processes did use Gloo, as the peer's error says.
    assert "[Gloo]" not in result.stdout
    assert "Gloo all-reduce failed" in result.stdout


def test_a_backend_that_is_not_installed_is_named_before_any_process_starts(tmp_path):
    pythonpath = pythonpath_without_torch(tmp_path)
    hidden = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=dict(os.environ, PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "No module named 'torch'" in hidden.stderr  # The shim works.
    result = _launch(
        tmp_path, "print('started')", "-n", "2", KERAS_BACKEND="torch", PYTHONPATH=pythonpath
    )
    assert result.returncode == 2, result.stderr
    assert "started" not in result.stdout and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # One message, not a traceback per process.
    assert lines[0].startswith("keras-accel launch: error: the Keras backend 'torch' (from ")
    assert "needs torch, which is not installed" in lines[0]
    assert 'pip install -c constraints.txt -e ".[torch]"' in lines[0]


ENV_REPORT = """
import os
print("OMP", os.environ.get("OMP_NUM_THREADS"), "TF", os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
"""


@pytest.mark.skipif(not is_installed("torch"), reason="the launcher refuses torch without it")
def test_torch_processes_get_one_openmp_thread_unless_the_user_chose(tmp_path):
    result = _launch(
        tmp_path,
        ENV_REPORT,
        "-n",
        "2",
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS=None,
        TF_CPP_MIN_LOG_LEVEL=None,
    )
    assert result.returncode == 0, result.stderr
    for i in range(2):
        assert f"[{i}] OMP 1 TF 2" in result.stdout.splitlines(), result.stdout
    notes = [line for line in result.stderr.splitlines() if "OMP_NUM_THREADS" in line]
    assert len(notes) == 1 and "as torchrun sets it" in notes[0], result.stderr
    # The user's values are kept, without a note.
    result = _launch(
        tmp_path,
        ENV_REPORT,
        "-n",
        "2",
        KERAS_BACKEND="torch",
        OMP_NUM_THREADS="3",
        TF_CPP_MIN_LOG_LEVEL="0",
    )
    assert result.returncode == 0, result.stderr
    assert "[1] OMP 3 TF 0" in result.stdout.splitlines(), result.stdout
    assert "OMP_NUM_THREADS" not in result.stderr


@pytest.mark.parametrize("backend_name", ["jax", "tensorflow"])
def test_jax_and_tensorflow_processes_keep_their_thread_pools(tmp_path, backend_name):
    result = _launch(
        tmp_path,
        ENV_REPORT,
        "-n",
        "2",
        KERAS_BACKEND=backend_name,
        OMP_NUM_THREADS=None,
        TF_CPP_MIN_LOG_LEVEL=None,
    )
    assert result.returncode == 0, result.stderr
    assert "[0] OMP None TF 2" in result.stdout.splitlines(), result.stdout
    assert "OMP_NUM_THREADS" not in result.stderr


def test_child_defaults():
    assert child_defaults("torch", 1, {}) == ({"TF_CPP_MIN_LOG_LEVEL": "2"}, [])
    env, notes = child_defaults("torch", 4, {"TF_CPP_MIN_LOG_LEVEL": "3"})
    assert env == {"OMP_NUM_THREADS": "1"} and len(notes) == 1
    assert child_defaults("jax", 4, {"OMP_NUM_THREADS": "8"}) == ({"TF_CPP_MIN_LOG_LEVEL": "2"}, [])


# TensorFlow 2.21's start-up lines as a process prints them (logged before absl's log is set
# up, where TF_CPP_MIN_LOG_LEVEL does not reach them), and jaxlib's Gloo lines.
PRELUDE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = (
    "I0000 00:00:1796458570.640959   10478 port.cc:153] oneDNN custom operations are on. You may "
    "see slightly different numerical results"
)
WARNING = "W0000 00:00:1796458570.641266   10478 some_file.cc:31] a warning"
CUINIT = (
    "E0000 00:00:1796458573.793656   10478 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)"
)
OTHER_ERROR = "E0000 00:00:1796458573.793656   10478 collective_ops.cc:12] Collective aborted"
GLOO_ALL = (
    "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
)
GLOO_MISSING = (
    "[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3"
)


def test_the_output_filter_leaves_out_what_says_nothing():
    quiet = OutputFilter({"TF_CPP_MIN_LOG_LEVEL": "2"})
    for line in (PRELUDE, ONEDNN, WARNING, GLOO_ALL):
        assert not quiet.keep(line), line
    for line in (OTHER_ERROR, GLOO_MISSING, "I0000 is what a user printed", "hello"):
        assert quiet.keep(line), line
    assert quiet.keep(CUINIT) is not quiet.no_gpu  # Only where there is no NVIDIA driver.
    loud = OutputFilter({"TF_CPP_MIN_LOG_LEVEL": "0"})  # The user asked for everything.
    for line in (PRELUDE, ONEDNN, WARNING, CUINIT):
        assert loud.keep(line), line
    assert not loud.keep(GLOO_ALL)


@pytest.mark.skipif(not is_installed("tensorflow"), reason="TensorFlow's own start-up lines")
def test_tensorflow_start_up_lines_are_left_out(tmp_path):
    body = """
        import tensorflow as tf
        print("sum", int(tf.constant(1) + 1))
    """
    started = time.monotonic()
    result = _launch(tmp_path, body, "-n", "2", TF_CPP_MIN_LOG_LEVEL=None)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "[0] sum 2" in lines and "[1] sum 2" in lines
    assert not any("absl::InitializeLog" in line or "] oneDNN custom" in line for line in lines)
    if not os.path.exists("/dev/nvidiactl"):
        assert "cuInit" not in result.stdout
    assert time.monotonic() - started < TIMEOUT_S
