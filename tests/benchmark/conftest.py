"""Fixtures for the benchmark tests: a calibrated address-space limit for real OOM tests."""

import keras
import pytest

from keras_accel.benchmark import isolate
from keras_accel.benchmark.spec import RunSpec

TINY_CONV = "tests.benchmark.tiny_models:wide_conv"
# Above the address space a small run needs, by this much: a batch of 512 of the tiny conv
# fits, 8192 (about 2-4 GiB more) does not.
HEADROOM_MB = 1024


@pytest.fixture(scope="session")
def memory_limit_mb():
    """An RLIMIT_AS for child processes, calibrated on this machine and backend.

    The address space of a Python process with JAX or TensorFlow loaded is 2-3 GiB before
    any training (libraries, thread stacks, allocator reservations) and depends on the
    machine, so a fixed limit would be fragile: measure a small run's peak and add headroom.
    """
    spec = RunSpec(TINY_CONV, keras.backend.backend(), batch_size=64, samples=64, epochs=1,
                   flops_from="analytic", measure_peak=False)  # fmt: skip
    record = isolate.run_isolated(spec.to_dict(), timeout_s=300, memory_limit_mb=None)
    assert record["status"] == "ok", record
    return record["VmPeak"] // 2**20 + HEADROOM_MB
