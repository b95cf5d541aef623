"""Derived figures and the report's Markdown, JSON, CSV and PNG forms (no child processes)."""

import csv
import importlib.util
import io
import json
import uuid

import pytest

from keras_accel.benchmark import isolate
from keras_accel.benchmark.results import BenchReport, BenchResult
from keras_accel.state import files


def _ok(backend, batch, epochs=(5.0, 2.0, 1.5), **extra):
    values = dict(
        samples=4096,
        epochs=len(epochs),
        epoch_seconds=list(epochs),
        steps_per_epoch=4096 // batch,
        static_batch=batch,
        flops_analytic=14e9 * batch / 256,
        peak_flops=2e11,
        peak_source="measured: matmul",
        devices=["cpu:0"],
        platform="cpu",
        device_kind="test cpu",
        strategy="single",
        num_replicas=1,
        compute_dtype="float32",
        memory_peak_bytes=2**30,
        memory_kind="host peak RSS",
        num_recompiles=0,
        data_source="synthetic CIFAR-10 stand-in (requested)",
    )
    values.update(extra)
    return BenchResult(backend, "mlp", batch, isolate.OK, **values)


@pytest.fixture
def report():
    results = [
        _ok("jax", 256, flops_xla=11e9, flops_xla_source="XLA cost analysis (hlo)"),
        _ok("jax", 1024, flops_xla=44e9, flops_xla_source="XLA cost analysis (hlo)"),
        BenchResult("jax", "mlp", 8192, isolate.OOM, 8192, 3, error="Out of memory allocating"),
        _ok("tensorflow", 256),
        _ok("tensorflow", 1024),
        BenchResult("tensorflow", "mlp", 8192, isolate.OK, 8192, 1, epoch_seconds=[7.0],
                    steps_per_epoch=1, static_batch=8192),
        BenchResult("torch", "mlp", 256, isolate.NOT_INSTALLED, 4096, 3),
    ]  # fmt: skip
    config = {"model": "mlp", "samples": 4096, "epochs": 3, "width": 1.0}
    return BenchReport(config, results, {"load_average": 0.5, "cpu_count": 2})


def test_derived_figures():
    r = _ok("jax", 256, flops_xla=11e9)
    assert r.first_epoch_seconds == 5.0
    assert r.steady_epoch_seconds == 1.5  # best epoch after the first, as the seed
    assert r.compile_seconds == pytest.approx(3.5)
    assert r.us_per_step == pytest.approx(1.5 / 16 * 1e6)
    assert r.samples_per_second == pytest.approx(4096 / 1.5)
    assert r.flops_per_step == 11e9 and r.flops_source.startswith("XLA")
    # 16 steps of 11 GFLOP in 1.5 s, on a 200 GFLOP/s peak.
    assert r.mfu == pytest.approx(16 * 11e9 / 1.5 / 2e11)


def test_padding_rows_do_not_count_as_useful_flops():
    # 1000 samples in batches of 256: 4 steps, the last padded to 256 rows.
    r = _ok("jax", 256, samples=1000, steps_per_epoch=4, flops_analytic=256e9)
    assert r.achieved_flops == pytest.approx(1e9 * 1000 / 1.5)


def test_single_epoch_and_failed_runs_have_no_steady_figures():
    single = BenchResult("jax", "mlp", 64, isolate.OK, 64, 1, epoch_seconds=[3.0])
    assert single.steady_epoch_seconds is None and single.mfu is None
    oom = BenchResult("jax", "mlp", 64, isolate.OOM, 64, 2)
    assert oom.first_epoch_seconds is None and oom.us_per_step is None


def test_seed_table_side_by_side(report):
    table = report.seed_table().splitlines()
    assert table[0] == (
        "| batch | jax s/epoch | tensorflow s/epoch | torch s/epoch | jax µs/step | "
        "tensorflow µs/step | torch µs/step |"
    )
    assert table[2].startswith("| 256 | 1.50 | 1.50 | not installed | 93,750 |")
    assert table[4] == "| 8192 | OOM | (7.00) |  | OOM | n/a |  |"


def test_markdown_has_every_figure_and_the_notes(report):
    text = report.to_markdown()
    assert "## keras-accel bench: mlp (width 1), 4096 samples, 3 epochs, float32" in text
    assert "Data: synthetic CIFAR-10 stand-in (requested)." in text
    assert "Host: 2 CPU cores, load average 0.50" in text
    assert "### jax: 1 x cpu (test cpu), strategy single" in text
    assert "| 256 | ok | 5.00 | 1.50 | 3.50 | 93,750 | 2,731 | 1.00 GiB | 11 | 14 | 0.20 |" in text
    assert "vs analytic 3 x forward Dense/Conv: 0.79 x at batch 256" in text
    assert "batch 8192: OOM: Out of memory allocating" in text
    assert "torch is not installed here" in text
    assert "| 8192 | OOM | n/a |" in text


def test_json_and_csv(report, tmp_path):
    report.to_json(str(tmp_path / "out" / "bench.json"))
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["config"]["model"] == "mlp"
    first = data["results"][0]
    assert first["steady_epoch_seconds"] == 1.5 and first["mfu"] == pytest.approx(0.5866, 1e-3)
    again = BenchReport.from_json(str(tmp_path / "out" / "bench.json"))
    assert again.to_markdown() == report.to_markdown()
    report.to_csv(str(tmp_path / "bench.csv"))
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 7
    assert rows[2]["status"] == "OOM" and rows[6]["status"] == "not installed"
    assert json.loads(rows[0]["epoch_seconds"]) == [5.0, 2.0, 1.5]


def test_plot_writes_a_png(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    report.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("store", ["memory", "s3", "gs"])
def test_json_csv_and_plot_to_urls(report, store, request):
    """Every output to a URL: memory://, and local S3 and GCS servers (tests/object_stores.py)."""
    if store != "memory":
        root = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[store])
    else:
        root = f"memory://bench-{uuid.uuid4().hex[:8]}"
    report.to_json(f"{root}/run/bench.json")
    assert BenchReport.from_json(f"{root}/run/bench.json").to_markdown() == report.to_markdown()
    report.to_csv(f"{root}/run/bench.csv")
    rows = list(csv.DictReader(io.StringIO(files.read_text(f"{root}/run/bench.csv"))))
    assert [r["status"] for r in rows] == [r.status for r in report.results]
    if importlib.util.find_spec("matplotlib") is not None:
        report.plot(f"{root}/run/bench.png")
        assert files.read_bytes(f"{root}/run/bench.png")[:8] == b"\x89PNG\r\n\x1a\n"
    if store == "memory":
        files.rmtree(root)


def test_measured_cpu_peak_is_the_best_of_the_sweep():
    from keras_accel.benchmark.results import _share_measured_peaks

    rows = [
        _ok("jax", 256, peak_flops=1e11, peak_source="measured: matmul (jax)"),
        _ok("jax", 1024, peak_flops=1.5e11, peak_source="measured: matmul (jax)"),
        _ok("tensorflow", 256, peak_flops=2e11, peak_source="measured: matmul (tensorflow)"),
        _ok("tensorflow", 1024, peak_flops=2e11, peak_source="given: 0.2 TFLOP/s"),
    ]
    _share_measured_peaks(rows)
    assert [r.peak_flops for r in rows] == [2e11, 2e11, 2e11, 2e11]
    assert "the best of the sweep's runs (tensorflow, batch 256 run)" in rows[0].peak_source
    assert rows[3].peak_source == "given: 0.2 TFLOP/s"  # a given peak is left alone


def test_backends_without_xla_counts_use_the_count_of_the_same_step():
    from keras_accel.benchmark.results import _share_xla_flops

    source = "XLA cost analysis (compiled)"
    rows = [
        _ok("jax", 256, flops_xla=11e9, flops_xla_source=source),
        _ok("tensorflow", 256),
        _ok("tensorflow", 1024),  # no JAX row of that shape: stays analytic
    ]
    _share_xla_flops(rows)
    assert rows[1].flops_xla == 11e9
    assert rows[1].flops_xla_source == "XLA cost analysis (compiled, from the jax run)"
    assert rows[2].flops_xla is None and rows[2].flops_source == "analytic (Dense/Conv)"
