"""scripts/gpu_bench.sh: its syntax, its dry run, and a CPU rehearsal of the JAX-only path."""

import json
import os
import pathlib
import subprocess

import pytest

from tests.benchmark.conftest import TINY_CONV
from tests.benchmark.test_cli import BLOCK_TENSORFLOW

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_bench.sh"
# The shared folder sits beside the repository root where this project is developed; a user's
# checkout has none, and the rehearsal then skips. KERAS_ACCEL_WHEELS points elsewhere.
SHARED_WHEELS = pathlib.Path(
    os.environ.get("KERAS_ACCEL_WHEELS", str(ROOT.parent / "shared" / "gpu-wheels"))
)
WHEEL_NAMES = [
    "keras-3.15.1-py3-none-any.whl",
    "namex-0.1.0-py3-none-any.whl",
    "optree-0.20.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
]


def _run(env_update, *args, timeout=60):
    env = dict(os.environ, **env_update)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_prints_the_seed_sweep_and_touches_nothing(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in WHEEL_NAMES:
        (wheels / name).write_bytes(b"")  # a dry run only lists them
    out = tmp_path / "out"
    result = _run({"WHEELS": str(wheels), "OUT": str(out)}, "--dry-run")
    assert result.returncode == 0, result.stderr
    log = result.stderr
    assert "pip install -q --no-index --no-deps --no-compile --target /tmp/site" in log
    benches = [line for line in log.splitlines() if "keras_accel.cli.main bench" in line]
    assert len(benches) == 4  # mlp and cnn, float32 and bfloat16
    for line in benches:
        assert "--batch-sizes 256,1024,4096,8192,16384,50000 --samples 50000" in line
        assert "--backends jax" in line
    assert {("mlp" in b, "bfloat16" in b) for b in benches} == {
        (True, True), (True, False), (False, True), (False, False)
    }  # fmt: skip
    assert not out.exists()


def test_missing_wheels_and_bad_arguments_are_clear(tmp_path):
    result = _run({"WHEELS": str(tmp_path / "nowhere")}, "--dry-run")
    assert result.returncode == 2 and "no wheels in" in result.stderr
    result = _run({}, "--fast")
    assert result.returncode == 2 and "unknown argument '--fast'" in result.stderr


@pytest.mark.slow
def test_rehearsal_on_this_cpu_with_keras_from_the_wheels(backend, tmp_path):
    # The GPU machine's situation, on this CPU: Keras installed from the carried wheel into a
    # fresh --target folder, TensorFlow unimportable, a tiny sweep through the real script.
    if backend != "jax":
        pytest.skip("the script is the JAX path")
    if not (SHARED_WHEELS / WHEEL_NAMES[0]).exists():
        pytest.skip(
            f"no {WHEEL_NAMES[0]} in {SHARED_WHEELS} (the shared folder beside the repository "
            "root, which a user's checkout does not have); set KERAS_ACCEL_WHEELS to a folder "
            "of the wheels to run this rehearsal"
        )
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCK_TENSORFLOW)
    out = tmp_path / "out"
    env = {
        "WHEELS": str(SHARED_WHEELS),
        "SITE": str(tmp_path / "site"),
        "OUT": str(out),
        "PYTHONPATH": str(tmp_path / "block"),
        "MODELS": TINY_CONV,
        "PRECISIONS": "float32",
        "BATCH_SIZES": "32",
        "SAMPLES": "32",
        "EPOCHS": "2",
        "FLOPS_FROM": "compiled",
        # The step-group rows (benchmarks/fusion.py) on a twentieth of each case's rows,
        # timed once: full size they were 150 of this test's 160 CPU-seconds.
        "STEP_GROUPS_SCALE": "0.05",
        "STEP_GROUPS_ROUNDS": "1",
    }
    # About 42 CPU-s; 175 s of wall beside the suite's lanes, more in its niced lane while
    # TensorFlow's run (the suite of 7 December timed out at 300 s): a margin for a loaded
    # machine, not a speed check.
    result = _run(env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "keras").is_dir()
    facts = (out / "env.txt").read_text()
    assert "backend jax" in facts and f"from {tmp_path / 'site' / 'keras'}" in facts
    name = f"{TINY_CONV}_float32"
    assert "| batch | jax s/epoch | jax µs/step |" in (out / f"{name}.md").read_text()
    (row,) = json.loads((out / f"{name}.json").read_text())["results"]
    assert row["status"] == "ok" and row["flops_xla"] > 0
    assert row["versions"]["keras"] == "3.15.1"
    groups = (out / "groups.md").read_text()
    assert "| jax | dense@64 |" in groups and "| jax | mlp@256 |" in groups, groups
