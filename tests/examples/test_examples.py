"""The examples run, small, as a user would run them, under the backend of the suite."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_keras_hub = pytest.mark.skipif(
    __import__("importlib").util.find_spec("keras_hub") is None, reason="keras-hub missing"
)


def _run(script, *args, timeout=420):
    # PYTHONFAULTHANDLER: if the example ever hangs, SIGABRT makes it print every thread's
    # Python stack, so the failure says where it stopped, not only that it timed out.
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"{script} did not finish in {timeout} s; its stacks when stopped:\n"
            f"{stderr[-6000:]}\nits output:\n{stdout[-2000:]}"
        )
    assert process.returncode == 0, (stdout[-3000:], stderr[-3000:])
    return stdout


def test_quickstart_example_says_what_it_waits_for():
    # README's first command runs it. Small: 2 replicas, 600 rows in batches of 128 (the
    # last padded), one epoch; on TensorFlow it says, before training, what the wait is.
    from tests.conftest import BACKEND

    out = _run(
        "quickstart.py", "--virtual-devices=2", "--samples=600", "--epochs=1", "--batch-size=128"
    )
    assert "(2 replicas)" in out and "training: 1 epoch(s) of 5 steps of 128 rows" in out, out
    assert ("builds a program for each of the 2 replicas" in out) == (BACKEND == "tensorflow")
    assert "the default on TensorFlow" not in out  # Only where the default rows are taken.
    assert "2000 predictions" in out and "recompiles after warm-up: 0" in out, out


def test_custom_training_loop_example(tmp_path):
    out = _run(
        "custom_training_loop.py",
        "--virtual-devices=4",
        "--samples=1000",
        "--test-samples=200",
        "--epochs=2",
        "--batch-size=64",
        "--width=0.125",
        "--steps-per-execution=4",
    )
    assert "over 4 replica(s)" in out and "predict:  200 rows of 10 probabilities" in out
    # 1000 rows in batches of 64 (the last padded), fused 4 per call (the last group of 4
    # holding 4 too: 16 batches): one compilation per step kind.
    assert "compilations {'train': 1, 'test': 1, 'predict': 1}" in out


@needs_keras_hub
# Both loops over 2 of the 8 devices: the same distributed code path (a global batch split,
# losses and metrics reduced across replicas), at a quarter of TensorFlow's cost of tracing
# one replica program per device on this machine's 2 cores (the fit over 8 took 74 CPU-s).
# The replica count is the subject of tests/adapter/test_exactness.py and test_text_inputs.py.
@pytest.mark.parametrize("loop,devices", [("fit", "2"), ("custom", "2")], ids=str)
def test_bert_classifier_example_learns(loop, devices, tmp_path):
    out = _run(
        "bert_classifier.py",
        f"--loop={loop}",
        "--virtual-devices=8",
        f"--devices={devices}",
        "--samples=256",
        "--epochs=2",
        f"--output={tmp_path}",
    )
    replicas = f"{devices} replica(s)"
    assert replicas in out, out
    assert "learned" in out and "NOT LEARNED" not in out, out
    if loop == "fit":
        assert (tmp_path / "bert_classifier.weights.h5").exists()
    else:  # The seed's CheckpointManager: the loop's backups, deleted once training ends.
        assert not (tmp_path / "checkpoints").exists()


def test_bert_classifier_reads_a_data_file_and_says_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("positive\tgreat movie\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bert_classifier.py"), f"--data={bad}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "expected 'label<TAB>text' with an integer label" in result.stderr


@needs_keras_hub
def test_gemma_lora_example_learns_and_generates():
    from tests.conftest import BACKEND

    if BACKEND != "jax":
        env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "gemma_lora.py")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode != 0 and "needs KERAS_BACKEND=jax" in done.stderr, done.stderr
        return
    out = _run("gemma_lora.py", "--virtual-devices=8", "--epochs=6")
    assert "fsdp over 8 device(s), mesh (8, 1)" in out, out
    assert "P('model', 'batch')" in out  # Gemma's own layout map, from its class.
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines()
              if line.startswith("epoch ")]  # fmt: skip
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], out
    generated = next(line for line in out.splitlines() if line.startswith("generate:"))
    assert generated.startswith("generate: 'the owl' -> 'the owl"), out


@needs_keras_hub
def test_gemma_lora_example_runs_on_one_device():
    # As a user without accelerators first runs it (no --virtual-devices): one device, where
    # a weight's JAX sharding has no layout `spec` to print (issue 34). One short epoch.
    from tests.conftest import BACKEND

    if BACKEND != "jax":
        pytest.skip("gemma_lora.py is JAX-only; its refusal on TensorFlow is tested above")
    out = _run("gemma_lora.py", "--epochs=1", "--samples=32")
    assert "fsdp over 1 device(s), mesh (1, 1)" in out, out
    assert "token_embedding (28, 64) whole on 1 device" in out, out
    assert "epoch 1: loss " in out and "generate: 'the owl' -> 'the owl" in out, out


def test_gemma_lora_without_keras_hub_says_which_extra():
    from tests.conftest import BACKEND

    if BACKEND != "jax":
        pytest.skip("gemma_lora.py is JAX-only; one run of this check is enough")
    # find_spec answers None for a module set to None in sys.modules: keras-hub "missing".
    run = (
        "import runpy, sys; sys.modules['keras_hub'] = None; sys.argv = ['gemma_lora.py']; "
        "runpy.run_path('examples/gemma_lora.py', run_name='__main__')"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "`nlp` extra" in done.stderr, done.stderr[-2000:]
    assert '-e ".[jax,nlp]"' in done.stderr, done.stderr[-2000:]
