"""`keras-accel bench` end to end: the table and the files, data errors, the JAX-only path."""

import csv
import io
import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from keras_accel.cli.main import main
from keras_accel.state import files
from tests.benchmark.conftest import TINY_CONV

RECORD = 1 + 32 * 32 * 3  # CIFAR-10 binary format: a label byte, then the pixels
FILES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def _cifar_binary(directory, records_per_file=4, truncate=None):
    """A real-format CIFAR-10 binary directory, tiny: 5 x `records_per_file` training images."""
    folder = directory / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in FILES:
        data = rng.integers(0, 256, (records_per_file, RECORD), dtype=np.uint8)
        data[:, 0] = rng.integers(0, 10, records_per_file)
        raw = data.tobytes()
        if name == truncate:
            raw = raw[: len(raw) - 100]
        (folder / name).write_bytes(raw)
    return folder


def test_bench_prints_the_table_and_writes_json_csv_plot(backend, tmp_path, capsys):
    out = tmp_path / "out"
    status = main([
        "bench", "--model", TINY_CONV, "--batch-sizes", "32,64", "--samples", "64",
        "--epochs", "2", "--backends", backend, "--flops-from", "hlo",
        "--json", str(out / "b.json"), "--csv", str(out / "b.csv"), "--plot", str(out / "b.png"),
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 0, captured.out
    assert f"| batch | {backend} s/epoch | {backend} µs/step |" in captured.out
    assert f"### {backend}: 1 x cpu" in captured.out
    assert "Data: synthetic CIFAR-10 stand-in" in captured.out
    assert "Peak FLOP/s: measured: 2048x2048 float32 matmul on this host" in captured.out
    assert "2/2" in captured.err  # progress on stderr
    data = json.loads((out / "b.json").read_text())
    rows = data["results"]
    assert [r["batch_size"] for r in rows] == [32, 64]
    for row in rows:
        assert row["status"] == "ok" and row["num_recompiles"] == 0
        assert len(row["epoch_seconds"]) == 2 and row["compile_seconds"] >= 0
        assert row["us_per_step"] > 0 and row["samples_per_second"] > 0
        assert row["memory_peak_bytes"] > 2**20 and row["memory_kind"] == "host peak RSS"
        assert row["flops_analytic"] > 0 and row["peak_flops"] > 0 and row["mfu"] > 0
        if backend == "jax":
            # XLA's count of the same step: forward + both backward matmuls, except the
            # input gradient of the first layer, which nothing needs.
            assert 0.5 < row["flops_xla"] / row["flops_analytic"] < 1.2
    with open(out / "b.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok", "ok"]
    assert (out / "b.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "case,expected",
    [
        ("truncated", "data_batch_1.bin: expected a whole number of 3073-byte CIFAR-10 binary"),
        ("too_many", "Asked for 64 training samples, but"),
        ("not_an_archive", "cannot read it as a (gzipped) tar archive"),
    ],
)
def test_bad_cifar10_is_a_clear_error(backend, tmp_path, capsys, case, expected):
    if case == "truncated":
        data = _cifar_binary(tmp_path, truncate="data_batch_1.bin")
    elif case == "too_many":
        data = _cifar_binary(tmp_path)  # 20 training images
    else:
        data = tmp_path / "cifar-10-binary.tar.gz"
        data.write_bytes(b"this is not a tar archive" * 40)
    status = main([
        "bench", "--model", "mlp", "--width", "0.05", "--batch-sizes", "16", "--samples", "64",
        "--epochs", "2", "--backends", backend, "--data", str(data), "--no-progress",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith("keras-accel bench: error: ")
    assert expected in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


BLOCK_TENSORFLOW = textwrap.dedent(
    """
    import sys

    class BlockTensorFlow:
        def find_spec(self, name, path=None, target=None):
            if name == "tensorflow" or name.startswith("tensorflow."):
                raise ImportError("TensorFlow is blocked for this test: " + name)

    sys.meta_path.insert(0, BlockTensorFlow())
    """
)


def test_the_jax_path_never_imports_tensorflow(backend, tmp_path):
    if backend != "jax":
        pytest.skip("the JAX path is exercised under KERAS_BACKEND=jax")
    # sitecustomize runs at start-up in the command's process and in every child it spawns.
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TENSORFLOW)
    env = dict(os.environ, KERAS_BACKEND="jax")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd(), env.get("PYTHONPATH", "")])
    command = [
        sys.executable, "-m", "keras_accel.cli.main", "bench", "--model", TINY_CONV,
        "--batch-sizes", "32", "--samples", "32", "--epochs", "2", "--backends", "jax",
        "--flops-from", "compiled", "--json", str(tmp_path / "b.json"), "--no-progress",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads((tmp_path / "b.json").read_text())["results"]
    assert row["status"] == "ok", row
    assert row["flops_xla_source"] == "XLA cost analysis (compiled)" and row["flops_xla"] > 0


def test_find_batch_size_command(backend, tmp_path, capsys):
    # No memory limit: the search doubles up to the maximum without an OOM, then recommends
    # 90% of it, rounded down to the granularity (a size it already measured).
    status = main([
        "bench", "--find-batch-size", "--model", TINY_CONV, "--backends", backend,
        "--start", "256", "--max-batch-size", "512", "--multiple-of", "256",
        "--json", str(tmp_path / "found.json"), "--no-progress",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"| {backend} | 256 |" in out and "| 512 | none | 2 |" in out
    (found,) = json.loads((tmp_path / "found.json").read_text())
    assert found["batch_size"] == 256 and found["max_batch_size"] == 512
    assert found["first_oom"] is None and found["samples_per_second"] > 0


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_bench_writes_its_outputs_to_a_bucket(backend, bucket, request, capsys):
    """--json/--csv/--plot to s3:// and gs:// on local servers (tests/object_stores.py), and
    nothing in the working directory. A timeout that no child meets keeps it cheap: the rows are
    TIMEOUT (exit status 1), and the outputs are written all the same. A missing bucket is
    refused before the sweep."""
    root = request.getfixturevalue(bucket)
    before = set(os.listdir("."))
    missing = f"{files.scheme(root)}://keras-accel-missing-{uuid.uuid4().hex[:8]}/b.json"
    assert main(["bench", "--backends", backend, "--json", missing, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert f"--json {missing!r} cannot be written" in captured.err and "bucket" in captured.err
    assert captured.out == ""  # Nothing measured.
    run = f"{root}/bench"
    status = main([
        "bench", "--model", "mlp", "--width", "0.05", "--batch-sizes", "16,32",
        "--samples", "64", "--epochs", "1", "--backends", backend, "--timeout", "0.001",
        "--json", f"{run}/b.json", "--csv", f"{run}/b.csv", "--plot", f"{run}/b.png",
        "--no-progress",
    ])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 1, captured.err
    rows = json.loads(files.read_text(f"{run}/b.json"))["results"]
    assert [(r["batch_size"], r["status"]) for r in rows] == [(16, "timeout"), (32, "timeout")]
    assert [r["status"] for r in csv.DictReader(io.StringIO(files.read_text(f"{run}/b.csv")))]
    assert files.read_bytes(f"{run}/b.png")[:4] == b"\x89PNG"
    assert set(os.listdir(".")) == before  # No local ./s3:/... or ./gs:/... tree.


def test_bench_refuses_an_output_it_cannot_write_before_measuring(backend, tmp_path, capsys):
    cases = [
        (["--json", "nosuchprotocol://bucket/b.json"], "--json 'nosuchprotocol://bucket/b.json'"),
        (["--csv", str(tmp_path)], "it is an existing directory"),
        (["--find-batch-size", "--plot", "x.png"], "--find-batch-size writes its result"),
    ]
    for extra, expected in cases:
        status = main([
            "bench", "--model", "mlp", "--batch-sizes", "16", "--samples", "64",
            "--backends", backend, "--no-progress", *extra,
        ])  # fmt: skip
        captured = capsys.readouterr()
        assert status == 2 and expected in captured.err, (extra, captured.err)
        assert captured.out == ""  # Refused before any measurement.
