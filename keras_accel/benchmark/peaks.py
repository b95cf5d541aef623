"""Peak FLOP/s of accelerators, by device kind and compute dtype: the denominator of MFU.

Figures are the vendors' dense (no structured sparsity) peaks for ONE device as the
frameworks list it: one CUDA device per GPU (a K80 board is two), one JAX device per TPU
core on v2/v3 and per chip from v4 on (megacore). A CPU has no table entry: the benchmark
measures a matmul on the spot instead (`measure_matmul_flops`).
"""

from __future__ import annotations

import time

TERA = 1e12

# Compute dtypes the table knows. "tf32" is what float32 matmuls run as on Ampere and later:
# XLA (JAX) and TensorFlow both allow TF32 for float32 dots by default there.
DTYPES = ("float32", "tf32", "bfloat16", "float16")

# (substring of the device kind, lower case) -> TFLOP/s by dtype. First match wins, so the
# more specific names ("h100 pcie") come before the general ones ("h100"). A dtype that the
# hardware does not accelerate (bfloat16 before Ampere, TF32 before Ampere) is absent: the
# lookup then falls back to float32, which is what the chip really delivers.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),
    ("h100 pcie", {"float32": 51.2, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0}),
    ("h100", {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4}),
    ("a100", {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0}),
    ("l40s", {"float32": 91.6, "tf32": 183.0, "bfloat16": 362.0, "float16": 362.0}),
    ("l40", {"float32": 90.5, "tf32": 90.5, "bfloat16": 181.0, "float16": 181.0}),
    ("l4", {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0}),
    ("v100", {"float32": 15.7, "float16": 125.0}),
    ("t4", {"float32": 8.1, "float16": 65.0}),
    # One GK210 (half a K80 board: 8.73 TFLOP/s float32 with boost for the board).
    ("k80", {"float32": 4.37}),
)

# Per JAX device. On TPUs the matrix units compute in bfloat16; float32 matmuls at the
# frameworks' default precision are single bfloat16 passes, so float32 gets the same peak.
TPU_PEAKS: tuple[tuple[str, float], ...] = (
    ("v6 lite", 918.0),  # v6e (Trillium), per chip
    ("v6e", 918.0),
    ("v5 lite", 197.0),  # v5e, per chip
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("v5", 459.0),  # v5p reports itself as "TPU v5"
    ("v4", 275.0),  # per chip (one megacore device)
    ("v3", 61.5),  # per core (123 per chip, 2 cores)
    ("v2", 22.5),  # per core (45 per chip, 2 cores)
)

_POLICY_DTYPES = {
    None: "float32",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "mixed_bfloat16": "bfloat16",
    "float16": "float16",
    "mixed_float16": "float16",
}


def compute_dtype(mixed_precision: str | None) -> str:
    """The dtype matmuls run in under a `mixed_precision` setting of the Accelerator.

    Example:
        >>> compute_dtype("bfloat16"), compute_dtype(None)
        ('bfloat16', 'float32')
    """
    try:
        return _POLICY_DTYPES[mixed_precision]
    except KeyError:
        valid = ", ".join(repr(k) for k in _POLICY_DTYPES)
        raise ValueError(
            f"Unknown mixed_precision. Received: mixed_precision={mixed_precision!r}. "
            f"Valid values: {valid}."
        ) from None


def peak_flops(platform: str, device_kind: str | None, dtype: str) -> tuple[float, str] | None:
    """Peak FLOP/s of one device from the table, and a label saying which entry was used.

    Args:
        platform: "gpu", "tpu" or "cpu" (a CPU has no entry: returns None).
        device_kind: the name the framework reports, e.g. JAX's `device.device_kind`
            ("NVIDIA H200", "TPU v5 lite") or TensorFlow's GPU `device_name`.
        dtype: "float32", "bfloat16" or "float16", the compute dtype. On GPUs with TF32,
            "float32" is looked up as "tf32", since XLA and TensorFlow use it by default.

    Returns:
        `(flops_per_second, label)`, or None when the device is not in the table.

    Example:
        >>> flops, label = peak_flops("gpu", "NVIDIA H200", "bfloat16")
        >>> flops / 1e12, label
        (989.4, 'table: h200 bfloat16 989.4 TFLOP/s')
        >>> peak_flops("gpu", "Tesla V100-SXM2-16GB", "bfloat16")[1]
        'table: v100 float32 15.7 TFLOP/s (no bfloat16 units)'
        >>> peak_flops("cpu", "x86_64", "float32") is None
        True
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"`dtype` must be 'float32', 'bfloat16' or 'float16'. Received: dtype={dtype!r}"
        )
    kind = (device_kind or "").lower()
    if platform == "gpu":
        for key, peaks in GPU_PEAKS:
            if key in kind:
                wanted = "tf32" if dtype == "float32" and "tf32" in peaks else dtype
                used = wanted if wanted in peaks else "float32"
                note = "" if used == wanted else f" (no {dtype} units)"
                value = peaks[used]
                return value * TERA, f"table: {key} {used} {value:g} TFLOP/s{note}"
        return None
    if platform == "tpu":
        for key, value in TPU_PEAKS:
            if key in kind:
                return value * TERA, f"table: tpu {key} bfloat16 {value:g} TFLOP/s"
        return None
    return None


def measure_matmul_flops(dtype: str = "float32", size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of a `size` x `size` matmul on the active Keras backend: a CPU's practical peak.

    The best of `repeats` timed runs after one warm-up, so thread start-up and the first
    compilation are not counted. Runs on the backend's default device.

    Example:
        >>> measure_matmul_flops(size=64, repeats=1) > 0
        True
    """
    import keras

    a = keras.ops.ones((size, size), dtype=dtype)
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        c = keras.ops.matmul(a, a)
        # Reading one element waits for the (possibly asynchronous) matmul to finish; as
        # float32, since TensorFlow cannot hand a bfloat16 scalar to numpy.
        keras.ops.convert_to_numpy(keras.ops.cast(c[0, 0], "float32"))
        if attempt:  # attempt 0 is the warm-up
            best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
