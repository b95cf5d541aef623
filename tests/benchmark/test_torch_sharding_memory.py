"""benchmarks/torch_sharding_memory.py at a tiny size: 2 processes under `fsdp`, figures
coherent (each process holds half of the replicated state, from the tensors' local shards;
no whole copy of a split weight or slot alive beside its shard). One launch: the suite's
time (data_parallel's figures are the replicated state, known here)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import BACKEND

# The processes are torch's whatever the run's backend: on the torch run only.
pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="torch's processes"),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "torch_sharding_memory.py"
TIMEOUT_S = 300


def test_fsdp_holds_half_of_the_state_in_each_of_two_processes(tmp_path):
    out = tmp_path / "figures.json"
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--processes", "2", "--width", "512", "--depth", "2",
         "--batch-size", "8", "--steps", "3", "--warmup", "1",
         "--strategies", "fsdp", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| 2 | fsdp |" in result.stdout  # The table.
    figures = json.loads(out.read_text())
    layer = (512 * 512 + 512) * 4
    assert figures["layer_bytes"] == layer
    assert figures["replicated_state_bytes"] == 3 * 2 * layer  # Weights and Adam's 2 slots.
    (fsdp,) = figures["rows"]
    assert fsdp["strategy"] == "fsdp" and fsdp["processes"] == 2
    # Every kernel, bias and slot has a dimension 2 divides: exactly half of each in each
    # process; scalars (the optimizer's step count) are kept whole.
    assert len(fsdp["per_process"]) == 2
    for process in fsdp["per_process"]:
        assert 0 <= process["state_bytes"] - 3 * layer <= 64, process
    assert fsdp["state_share"] == pytest.approx(0.5, abs=1e-5)
    # The tensors alive between steps: the shards, not the whole weights and slots beside
    # them (which the fsdp runtime kept alive before: a layer's own registration of its
    # variables' tensors, the slots' whole tensors kept for the call's end).
    assert fsdp["state_bytes"] <= fsdp["live_bytes"] < fsdp["state_bytes"] + layer, fsdp
    assert fsdp["peak_bytes"] >= fsdp["held_bytes"] > 0
    assert fsdp["step_s"] > 0
    assert fsdp["step_vs_data_parallel"] is None  # No data_parallel row to compare with.
