"""Batches placed one step ahead (`keras_accel.data.ahead.OneBatchAhead`, what `acc.fit` feeds
Keras's JAX trainer from arrays and PyDatasets): when a step takes batch k, batch k + 1 is
already gathered and on its way to the devices, laid out as the step wants it."""

import keras
import numpy as np
import pytest

from keras_accel.data.ahead import OneBatchAhead
from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.batching import unpack
from keras_accel.data.pydataset import StaticBatchDataset
from tests.conftest import BACKEND

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _batches(rows=40, batch=8, shuffle=True):
    x = np.arange(rows * 2, dtype="float32").reshape(rows, 2)
    y = np.arange(rows, dtype="int64")
    return ArrayBatches(
        x, y, batch_size=batch, num_replicas=1, shuffle=shuffle, seed=0, training=True
    )


class _Recording:
    """A StaticBatchDataset that logs each batch it gathers, and a `place` that logs too."""

    def __init__(self, batches, fail_at=None):
        self.log = []
        self.fail_at = fail_at
        outer = self

        class Dataset(StaticBatchDataset):
            def __getitem__(self, index):
                if index == outer.fail_at:
                    raise RuntimeError(f"batch {index} is unreadable")
                outer.log.append(("gather", index))
                return super().__getitem__(index)

        self.dataset = Dataset(batches)

    def place(self, batch):
        self.log.append(("place", len(self.log)))
        return batch


def test_the_next_batch_is_gathered_and_placed_before_the_step_takes_this_one():
    recording = _Recording(_batches())
    ahead = OneBatchAhead(recording.dataset, recording.place)
    seen = []
    for k, batch in enumerate(ahead.get_jax_iterator()):
        gathered = [i for kind, i in recording.log if kind == "gather"]
        seen.append(k)
        assert gathered == list(range(min(k + 2, 5))), (k, gathered)
        x, y, _, mask = unpack(batch)
        np.testing.assert_array_equal(x, recording.dataset.batches.batch(k)[0])
    assert seen == [0, 1, 2, 3, 4]
    assert sum(kind == "place" for kind, _ in recording.log) == 5


def test_an_unreadable_next_batch_fails_after_this_one_is_served():
    recording = _Recording(_batches(), fail_at=3)
    iterator = OneBatchAhead(recording.dataset, recording.place).get_jax_iterator()
    served = [next(iterator) for _ in range(3)]  # Batch 2 comes before batch 3's error.
    assert len(served) == 3
    with pytest.raises(RuntimeError, match="batch 3 is unreadable"):
        next(iterator)


def test_a_batch_gathered_before_an_epoch_ended_is_gathered_again_in_the_next_order():
    batches = _batches()
    recording = _Recording(batches)
    ahead = OneBatchAhead(recording.dataset, recording.place)
    iterator = ahead.get_jax_iterator()
    next(iterator)  # Batch 0 served; batch 1 gathered under epoch 0's order.
    ahead.on_epoch_end()  # Keras ends the epoch (`steps_per_epoch=1`), the iterator kept.
    assert batches.epoch == 1
    x, _, _, _ = unpack(next(iterator))
    np.testing.assert_array_equal(x, batches.batch(1, epoch=1)[0])
    assert not np.array_equal(x, batches.batch(1, epoch=0)[0])


def test_its_length_and_first_batch_are_the_datasets():
    dataset = StaticBatchDataset(_batches())
    ahead = OneBatchAhead(dataset, lambda batch: batch)
    assert ahead.num_batches == 5
    x, y, _, mask = ahead.keras_accel_first_batch()
    np.testing.assert_array_equal(x, unpack(dataset[0])[0])


@pytest.mark.skipif(BACKEND != "jax", reason="placement on JAX devices")
def test_acc_fit_places_batches_as_the_distribution_lays_them_out():
    import jax

    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    batches = acc.feeder.batches(x, y, 16, True, None, None, True, "pad")
    data = acc.runtime.wrap(batches, carry_mask=True)
    if acc.distribution is None and acc.devices[0].startswith("cpu"):
        assert isinstance(data, StaticBatchDataset)  # One CPU device: no look-ahead.
        return
    assert isinstance(data, OneBatchAhead)
    batch = next(iter(data.get_jax_iterator()))
    x_placed = unpack(batch)[0]
    assert isinstance(x_placed, jax.Array)
    if acc.distribution is not None:
        layout = acc.distribution.get_data_layout(x_placed.shape).backend_layout
        assert x_placed.sharding.is_equivalent_to(layout, x_placed.ndim)
        assert len(x_placed.sharding.device_set) == acc.num_replicas
    with acc.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2


@pytest.mark.skipif(BACKEND != "jax", reason="placement on JAX devices")
def test_one_cpu_device_reads_without_look_ahead_as_keras_does():
    from keras_accel import Accelerator
    from keras_accel.utils import keras_internals

    acc = Accelerator(strategy="single")
    x = np.zeros((32, 4), "float32")
    batches = acc.feeder.batches(x, np.zeros(32, "int64"), 16, True, None, None, True, "pad")
    wrapped = acc.runtime.wrap(batches, carry_mask=True)
    if keras_internals.keras_scans_steps():  # Keras 3.16: our adapter stacks its groups,
        assert isinstance(wrapped, OneBatchAhead)  # placing nothing ahead.
        assert isinstance(wrapped.dataset, StaticBatchDataset)
    else:
        assert isinstance(wrapped, StaticBatchDataset)


@pytest.mark.skipif(BACKEND != "jax", reason="Keras's JAX trainer asks for super batches")
def test_super_batches_as_keras_3_16_asks_for_them():
    """Keras 3.16 runs `steps_per_execution=N` as one scan over N stacked batches and asks
    `get_jax_iterator(super_batch=N)` for them (the short last group as a list); Keras 3.15
    never asks, and gets the batches one by one."""
    from keras_accel.utils import keras_internals

    recording = _Recording(_batches())  # 5 batches of 8 rows
    ahead = OneBatchAhead(recording.dataset, recording.place)
    assert len(list(ahead.get_jax_iterator())) == 5
    try:
        keras_internals.super_batch_iterator()
    except keras_internals.KerasInternalsError as error:  # Keras 3.15: nothing asks.
        assert "super_batch_iterator" in str(error) and keras.__version__ in str(error)
        return
    groups = list(ahead.get_jax_iterator(super_batch=2))
    assert [type(g).__name__ for g in groups] == ["tuple", "tuple", "PartialBatchList"]
    x, _, _, mask = unpack(groups[0])
    assert x.shape == (2, 8, 2) and mask.shape[:2] == (2, 8)
    np.testing.assert_array_equal(x[1], recording.dataset.batches.batch(1)[0])
