"""The device peak table and the compute dtype of a precision policy."""

import pytest

from keras_accel.benchmark.peaks import compute_dtype, measure_matmul_flops, peak_flops


@pytest.mark.parametrize(
    "platform,kind,dtype,tflops,used",
    [
        ("gpu", "NVIDIA H200", "bfloat16", 989.4, "bfloat16"),
        ("gpu", "NVIDIA H200", "float32", 494.7, "tf32"),  # XLA/TF use TF32 for float32 dots
        ("gpu", "NVIDIA H100 80GB HBM3", "float16", 989.4, "float16"),
        ("gpu", "NVIDIA H100 PCIe", "bfloat16", 756.0, "bfloat16"),
        ("gpu", "NVIDIA A100-SXM4-40GB", "bfloat16", 312.0, "bfloat16"),
        ("gpu", "NVIDIA L4", "bfloat16", 121.0, "bfloat16"),
        ("gpu", "Tesla V100-SXM2-16GB", "float16", 125.0, "float16"),
        ("gpu", "Tesla V100-SXM2-16GB", "bfloat16", 15.7, "float32"),  # no bf16 units
        ("gpu", "Tesla T4", "float32", 8.1, "float32"),
        ("gpu", "Tesla K80", "float32", 4.37, "float32"),
        ("tpu", "TPU v2", "bfloat16", 22.5, "bfloat16"),
        ("tpu", "TPU v3", "float32", 61.5, "bfloat16"),
        ("tpu", "TPU v4", "bfloat16", 275.0, "bfloat16"),
        ("tpu", "TPU v5 lite", "bfloat16", 197.0, "bfloat16"),
        ("tpu", "TPU v5p", "bfloat16", 459.0, "bfloat16"),
    ],
)
def test_table(platform, kind, dtype, tflops, used):
    flops, label = peak_flops(platform, kind, dtype)
    assert flops == pytest.approx(tflops * 1e12)
    assert f" {used} " in label


def test_unknown_devices_and_cpu_have_no_entry():
    assert peak_flops("gpu", "Some Future GPU", "float32") is None
    assert peak_flops("tpu", "TPU v9", "bfloat16") is None
    assert peak_flops("cpu", "AMD EPYC", "float32") is None


def test_bad_dtype_and_policy():
    with pytest.raises(ValueError, match="Received: dtype='int8'"):
        peak_flops("gpu", "NVIDIA H200", "int8")
    assert compute_dtype("mixed_bfloat16") == "bfloat16"
    assert compute_dtype("float16") == "float16"
    with pytest.raises(ValueError, match="Valid values"):
        compute_dtype("float64")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_measurement_is_positive(dtype):
    assert measure_matmul_flops(dtype, size=128, repeats=2) > 1e6
