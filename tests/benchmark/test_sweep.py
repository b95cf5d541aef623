"""Sweeps in real child processes: a real out-of-memory row, "not installed", side by side."""

import json

import keras
import pytest

from keras_accel.benchmark import isolate, run_benchmark
from keras_accel.benchmark.spec import BACKEND_MODULES, backend_installed
from keras_accel.cli.main import main
from tests.benchmark.conftest import TINY_CONV

MISSING = next((name for name in BACKEND_MODULES if not backend_installed(name)), None)


def test_out_of_memory_is_a_row_and_the_sweep_goes_on(backend, memory_limit_mb):
    # 8192 images through a 32-channel convolution need gigabytes more than the limit leaves:
    # the child really fails to allocate (RLIMIT_AS), and the next, small batch runs clean.
    backends = [backend] + ([MISSING] if MISSING else [])
    report = run_benchmark(
        TINY_CONV,
        [8192, 512],
        backends=backends,
        samples=8192,
        epochs=2,
        flops_from="analytic",
        measure_peak=False,
        memory_limit_mb=memory_limit_mb,
        timeout_s=300,
        progress=False,
    )
    oom, small = report.get(backend, 8192), report.get(backend, 512)
    assert oom.status == isolate.OOM, (oom.error, memory_limit_mb)
    print(backend, "OOM reason:", oom.error)
    assert small.status == isolate.OK, small.error
    assert small.steady_epoch_seconds > 0 and small.num_recompiles == 0
    assert small.samples_per_second > 0 and small.flops_analytic > 0
    table = report.seed_table()
    assert "| 8192 | OOM |" in table
    if MISSING:
        assert report.get(MISSING, 512).status == isolate.NOT_INSTALLED
        assert "| not installed |" in table.splitlines()[3]


def test_exit_without_a_record_is_classified():
    assert isolate.classify_exit(-9, "")[0] == isolate.OOM
    assert isolate.classify_exit(-6, "terminate called after throwing std::bad_alloc")[0] == "OOM"
    assert isolate.classify_exit(-11, "Segmentation fault")[0] == isolate.ERROR
    missing = isolate.classify_exit(1, "ModuleNotFoundError: No module named 'torch'")
    assert missing[0] == isolate.NOT_INSTALLED
    assert isolate.classify_exception(MemoryError()) == isolate.OOM
    error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.2GiB")
    assert isolate.classify_exception(error) == isolate.OOM
    assert isolate.classify_exception(ValueError("bad shape")) == isolate.ERROR


def test_child_timeout_is_reported(backend):
    record = isolate.run_isolated(
        {"model": TINY_CONV, "backend": backend, "batch_size": 64, "samples": 64, "epochs": 1},
        timeout_s=0.5,
    )
    assert record["status"] == isolate.TIMEOUT and "killed" in record["error"]


@pytest.mark.slow
@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="runs both backends in child processes whatever the parent's: once, under JAX",
)
def test_both_backends_side_by_side_with_the_seed_mlp(tmp_path, capsys):
    # The seed MLP (narrowed 20x to stay quick) on both backends, each in its own processes.
    backends = "jax,tensorflow" + (f",{MISSING}" if MISSING else "")
    status = main([
        "bench", "--model", "mlp", "--width", "0.05", "--batch-sizes", "64", "--samples",
        "128", "--epochs", "2", "--backends", backends, "--flops-from", "hlo",
        "--json", str(tmp_path / "b.json"),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    header = "| batch | jax s/epoch | tensorflow s/epoch |"
    assert out.count(header) == 1
    data = json.loads((tmp_path / "b.json").read_text())
    by_backend = {r["backend"]: r for r in data["results"]}
    assert by_backend["jax"]["status"] == by_backend["tensorflow"]["status"] == "ok"
    # JAX counts FLOPs with XLA; TensorFlow has no cost analysis and takes JAX's count of
    # the same step, so that both MFUs share a numerator; the analytic counts agree too.
    jax_row, tf_row = by_backend["jax"], by_backend["tensorflow"]
    assert jax_row["flops_xla"] > 0 and tf_row["flops_xla"] == jax_row["flops_xla"]
    assert tf_row["flops_xla_source"] == "XLA cost analysis (hlo, from the jax run)"
    assert jax_row["flops_analytic"] == tf_row["flops_analytic"]
    assert 0 < by_backend["jax"]["mfu"] < 1.5 and 0 < by_backend["tensorflow"]["mfu"] < 1.5
    if MISSING:
        assert by_backend[MISSING]["status"] == "not installed"
