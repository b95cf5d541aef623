"""Benchmarks: the seed's seconds-per-epoch sweep as one call, OOM-proof, with MFU.

`run_benchmark` times a model at several batch sizes on one or more Keras backends, every
configuration in its own child process (an out-of-memory error becomes an "OOM" row, not a
crash); `find_batch_size` finds the largest batch that trains. `keras-accel bench` is the
command-line form of both.

Example:
    >>> from keras_accel.benchmark import MODELS, peak_flops
    >>> sorted(MODELS)
    ['bert', 'cnn', 'mlp']
    >>> peak_flops("gpu", "NVIDIA H200", "bfloat16")[0] / 1e12
    989.4
"""

from keras_accel.benchmark.finder import (
    BatchSizeResult,
    BatchSizeSearchError,
    find_batch_size,
    search_batch_size,
)
from keras_accel.benchmark.peaks import measure_matmul_flops, peak_flops
from keras_accel.benchmark.results import BenchReport, BenchResult
from keras_accel.benchmark.spec import MODELS, BenchInputError
from keras_accel.benchmark.sweep import run_benchmark

__all__ = [
    "MODELS",
    "BatchSizeResult",
    "BatchSizeSearchError",
    "BenchInputError",
    "BenchReport",
    "BenchResult",
    "find_batch_size",
    "measure_matmul_flops",
    "peak_flops",
    "run_benchmark",
    "search_batch_size",
]
