"""`Accelerator.describe(model)`: each variable's layout as its array holds it, on both
backends; the expected layouts are written out, and the bytes are checked against the
devices' own shards (JAX) or copies (TF)."""

import collections

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.adapter.layouts import LayoutReport
from tests.helpers import data


def _model(optimizer="adam"):
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(32, name="wide"),
            keras.layers.Dense(3, "softmax", name="classes"),
        ],
        name="net",
    )
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["acc"])
    return model


def _trained(acc):
    with acc.scope():
        model = _model()
    x, y = data(32)
    acc.fit(model, x, y, batch_size=16, epochs=1, verbose=0)  # Builds the optimizer's slots.
    return model


def _rows(report):
    return {(row.owner, row.path): row for row in report}


def _held_per_device(model):
    """Bytes each device holds of the model's variables, summed from the arrays' shards."""
    held = collections.Counter()
    for variable in model.variables:
        for shard in variable.value.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return held


def test_fsdp_rows_say_what_each_device_holds(backend, num_devices):
    if backend != "jax":
        pytest.skip("fsdp is JAX's: tests/adapter/test_fsdp.py checks TF's refusal")
    acc = Accelerator(strategy="fsdp")
    model = _trained(acc)
    report = acc.describe(model)
    rows = _rows(report)
    n = num_devices
    kernel = rows["model", "net/wide/kernel"]
    assert (kernel.shape, kernel.layout, kernel.per_device_shape) == (
        (6, 32),
        "P(None, 'batch')",
        (6, 32 // n),
    )
    assert (kernel.num_devices, kernel.bytes_per_device, kernel.total_bytes) == (
        n,
        6 * 32 // n * 4,
        6 * 32 * 4,
    )
    assert rows["model", "net/wide/bias"].layout == "P('batch',)"
    assert rows["model", "net/classes/kernel"].layout == "P('batch', None)"  # (32, 3): the 32.
    bias = rows["model", "net/classes/bias"]  # 3 classes: nothing 8 divides, whole everywhere.
    assert (bias.layout, bias.per_device_shape) == ("replicated", (3,))
    # Adam's slots lie as their variable does; its iteration count is whole everywhere.
    slots = [
        row for (owner, path), row in rows.items() if owner == "optimizer" and "wide_kernel" in path
    ]
    assert len(slots) == 2 and {row.layout for row in slots} == {"P(None, 'batch')"}
    assert rows["optimizer", "adam/iteration"].layout == "replicated"
    assert {row.owner for row in report} >= {"model", "optimizer", "metrics"}
    # The model's bytes per device are what each device's shards hold.
    held = _held_per_device(model)
    assert len(held) == n and set(held.values()) == {report.bytes_per_device("model")}
    assert report.total_bytes("model") == sum(v.value.nbytes for v in model.variables)
    assert report.bytes_per_device() < report.total_bytes()


def test_replicated_rows_hold_everything_on_every_device(backend, num_devices):
    acc = Accelerator()  # data_parallel (JAX) / MirroredStrategy (TF) over every device.
    model = _trained(acc)
    report = acc.describe(model)
    want = "replicated" if backend == "jax" else "mirrored"
    for row in report:
        if num_devices > 1:
            assert (row.layout, row.num_devices) == (want, num_devices), row
        assert row.per_device_shape == row.shape, row
    assert report.bytes_per_device() == report.total_bytes()
    model_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.variables)
    assert report.bytes_per_device("model") == model_bytes
    if backend == "jax":
        assert set(_held_per_device(model).values()) == {model_bytes}
    else:  # Each replica's copy, on its own device.
        kernel = model.get_layer("wide").kernel.value
        copies = getattr(kernel, "values", (kernel,))
        assert len({c.device for c in copies}) == num_devices


def test_one_device_names_it(backend):
    acc = Accelerator(strategy="single")
    with acc.scope():
        model = _model()
    report = acc.describe(model)
    assert [(row.owner, row.path, row.layout) for row in report if row.owner == "model"] == [
        ("model", "net/wide/kernel", "cpu:0"),
        ("model", "net/wide/bias", "cpu:0"),
        ("model", "net/classes/kernel", "cpu:0"),
        ("model", "net/classes/bias", "cpu:0"),
    ]


def test_the_table_has_a_row_per_variable_and_the_totals(num_devices):
    acc = Accelerator()
    with acc.scope():
        model = _model()
    text = str(acc.describe(model))
    lines = text.splitlines()
    assert lines[0].startswith(f"{model.name} under {acc.strategy_name} on {num_devices} device")
    assert lines[1].split() == ["variable", "shape", "dtype", "layout", "per", "device", "bytes"]
    assert lines[2].split()[:4] == ["net/wide/kernel", "(6,", "32)", "float32"]
    assert lines[2].endswith("768 B")  # 6 x 32 float32, whole on each device.
    # 6*32 + 32 + 32*3 + 3 = 323 floats, whole on each device.
    assert lines[-1].startswith("per device: model 1.3 KiB of 1.3 KiB")
    assert (
        isinstance(acc.describe(model), LayoutReport) and len(acc.describe(model)) == len(lines) - 3
    )


def test_bad_inputs_are_clear_errors():
    acc = Accelerator()
    with pytest.raises(TypeError, match=r"Expected a keras.Model. Received: str"):
        acc.describe("model")
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"has no variables yet: build it first"):
        acc.describe(unbuilt)
    with acc.scope():
        model = _model()
    with pytest.raises(ValueError, match=r"`owner` must be one of .* Received: owner='weights'"):
        acc.describe(model).bytes_per_device("weights")
