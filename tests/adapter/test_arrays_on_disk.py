"""Arrays on disk through `acc.fit`, `evaluate` and `predict` on every backend: a read-only
memory map and an array-like over one (which counts its reads and refuses to be converted
whole) give exactly the results of the same arrays in memory, on uneven data with
validation_split and sample or class weights, and the array-like is read a batch of rows
at a time: a call that copied its input whole fails here. On TensorFlow neither becomes a
host tensor (the in-memory path's programs hold their arrays whole). Memory itself is
measured in benchmarks/arrays_on_disk.py."""

import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.data import on_disk
from tests.data.test_on_disk import CountingRows
from tests.helpers import FEW_REPLICAS, compiled_mlp, data

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

ROWS, BATCH = 203, 8  # 152 rows to train on (19 batches), 51 to validate (the last of 3).


def _memmap(path, array):
    written = np.memmap(path, array.dtype, "w+", shape=array.shape)
    written[:] = array
    written.flush()
    return np.memmap(path, array.dtype, "r", shape=array.shape)


def _run(devices, weights, x, y, w, initial):
    acc = Accelerator(seed=0, devices=devices)
    with acc.scope():
        model = compiled_mlp()
    model.set_weights(initial)
    options = {"class_weight": {1: 3.0}} if weights == "class" else {"sample_weight": w}
    history = acc.fit(
        model, x, y, batch_size=BATCH, epochs=2, validation_split=0.25, verbose=0, **options
    )
    return {
        "history": history.history,
        "weights": model.get_weights(),
        "evaluate": acc.evaluate(model, x, y, batch_size=BATCH, verbose=0),
        "predict": acc.predict(model, x, batch_size=BATCH, verbose=0),
    }


def _assert_equal(got, want, where, tolerance=0.0):
    """Equal, bit for bit where `tolerance` is 0."""

    def close(g, v, message):
        np.testing.assert_allclose(g, v, rtol=tolerance, atol=tolerance, err_msg=message)

    assert got["history"].keys() == want["history"].keys()
    for key in want["history"]:
        close(got["history"][key], want["history"][key], f"{where}: {key}")
    for i, (g, v) in enumerate(zip(got["weights"], want["weights"], strict=True)):
        close(g, v, f"{where}: weight {i}")
    close(got["evaluate"], want["evaluate"], f"{where}: evaluate")
    close(got["predict"], want["predict"], f"{where}: predict")


# Several devices on torch are several processes (tests/adapter/test_torch.py).
CASES = [(1, "sample"), (1, "class")] + ([(FEW_REPLICAS, "sample")] if FEW_REPLICAS > 1 else [])


@pytest.mark.parametrize("devices, weights", CASES)
def test_fit_evaluate_predict_on_disk_equal_arrays_in_memory_read_a_batch_at_a_time(
    tmp_path, backend, monkeypatch, devices, weights
):
    if backend == "torch" and devices > 1:
        pytest.skip("a torch process is one device")
    x, y = data(ROWS)
    w = np.linspace(0.5, 2.0, ROWS).astype("float32")
    mapped = [_memmap(tmp_path / f"{name}.dat", a) for name, a in (("x", x), ("y", y), ("w", w))]
    counting = [CountingRows(a) for a in mapped]
    initial = compiled_mlp().get_weights()
    want = _run(devices, weights, x, y, w, initial)
    if backend == "tensorflow":
        from keras_accel.data import tfdata

        host_tensor = tfdata._host_tensor

        def whole(array):
            assert not on_disk.on_disk(array), "an array on disk was made a host tensor whole"
            return host_tensor(array)

        monkeypatch.setattr(tfdata, "_host_tensor", whole)
    # TensorFlow's replicas read data on disk through Keras's own adapter, whose batches
    # have no static size: other kernels, the same numbers up to float rounding.
    tolerance = 1e-6 if backend == "tensorflow" and devices > 1 else 0.0
    _assert_equal(_run(devices, weights, *mapped, initial), want, "memmap", tolerance)
    _assert_equal(_run(devices, weights, *counting, initial), want, "array-like", tolerance)
    reads = [n for leaf in counting for n in leaf.reads]
    assert reads and max(reads) <= BATCH  # Batch by batch; the whole input never.
