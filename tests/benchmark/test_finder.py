"""The batch-size finder: its search on a model of memory, and on a real memory limit."""

import pytest

from keras_accel.benchmark import BatchSizeSearchError, find_batch_size, search_batch_size
from keras_accel.benchmark.finder import Try
from keras_accel.benchmark.spec import BenchInputError
from tests.benchmark.conftest import TINY_CONV


def _fits_up_to(limit, calls):
    def trial(size):
        calls.append(size)
        return Try(size, "ok" if size <= limit else "OOM", samples_per_second=float(size))

    return trial


@pytest.mark.parametrize("limit", [100, 127, 128, 129, 1000, 5000])
def test_search_brackets_the_limit(limit):
    calls = []
    largest, first_oom, tries = search_batch_size(_fits_up_to(limit, calls), 8, 8192, 8)
    assert largest == limit // 8 * 8
    assert first_oom - largest <= 8 and first_oom > limit
    assert calls == [t.batch_size for t in tries]
    assert len(calls) <= 2 * 12  # doubling, then bisection: logarithmic


def test_search_stops_at_the_maximum_without_oom():
    largest, first_oom, tries = search_batch_size(_fits_up_to(10**9, []), 64, 1000, 8)
    assert (largest, first_oom) == (1000, None)
    assert [t.batch_size for t in tries] == [64, 128, 256, 512, 1000]


def test_search_refuses_when_start_does_not_fit_or_a_try_errors():
    with pytest.raises(BatchSizeSearchError, match="Even the starting batch size 64"):
        search_batch_size(_fits_up_to(10, []), 64, 1024, 8)

    def broken(size):
        return Try(size, "error", error="ValueError: shapes")

    with pytest.raises(BatchSizeSearchError, match="not out of memory.*ValueError: shapes"):
        search_batch_size(broken, 64, 1024, 8)


def test_bad_arguments():
    with pytest.raises(BenchInputError, match="margin"):
        find_batch_size("mlp", margin=1.5)
    with pytest.raises(BenchInputError, match="start=8192, max_batch_size=1024"):
        find_batch_size("mlp", start=8192, max_batch_size=1024)
    with pytest.raises(BenchInputError, match="Valid models"):
        find_batch_size("alexnet")


def test_finds_the_largest_batch_under_a_real_memory_limit(backend, memory_limit_mb):
    # Every try is a child process under RLIMIT_AS: sizes past the limit really fail to
    # allocate. About 2,000 images of the wide convolution fit in the headroom on JAX, about
    # 5,000 on TensorFlow (its CPU kernels keep fewer buffers); 8192 fit on neither. The
    # granularity is a quarter to a half of that, so the search takes about four tries.
    step = {"jax": 1024, "tensorflow": 2048}.get(backend, 1024)
    found = find_batch_size(
        TINY_CONV,
        backend=backend,
        start=step,
        max_batch_size=16384,
        multiple_of=step,
        margin=0.1,
        steps=1,
        memory_limit_mb=memory_limit_mb,
        timeout_s=300,
        progress=False,
    )
    statuses = {t.batch_size: t.status for t in found.tries}
    assert statuses[found.max_batch_size] == "ok"
    assert found.first_oom is not None and statuses[found.first_oom] == "OOM"
    assert 0 < found.first_oom - found.max_batch_size <= step
    assert all(status == "ok" for size, status in statuses.items() if size < found.first_oom)
    assert found.batch_size == max(step, int(found.max_batch_size * 0.9) // step * step)
    assert found.samples_per_second > 0
    assert found.backend == backend and "samples/s" in found.summary()
