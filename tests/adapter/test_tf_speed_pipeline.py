"""The in-memory array pipeline gathers several batches per tf.data call
(`keras_accel.data.tfdata._group_loader`): every batch must be the one the per-batch path
(`_padded`, still used with a model's preprocessing) makes, value for value: the same rows
in the same order, the same padding, weights and row mask. Over several replicas, an epoch's
per-device iterators are made only when read (`runtime.Distributed`)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from keras_accel.data import tfdata  # noqa: E402
from keras_accel.data.sources import ArrayBatches  # noqa: E402


def _identity(x, y, sample_weight):  # A preprocess that changes nothing: the per-batch path.
    return x, y, sample_weight


def _elements(dataset):
    return [tf.nest.map_structure(lambda t: t.numpy(), e) for e in dataset]


def _assert_same(grouped, reference):
    assert tf.nest.map_structure(lambda s: (s.shape, s.dtype), grouped.element_spec) == (
        tf.nest.map_structure(lambda s: (s.shape, s.dtype), reference.element_spec)
    )
    assert int(grouped.cardinality()) == int(reference.cardinality())  # Keras's steps.
    got, want = _elements(grouped), _elements(reference)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        tf.nest.assert_same_structure(a, b)
        for u, v in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
            assert u.dtype == v.dtype and u.shape == v.shape
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("carry_mask", [True, False])
@pytest.mark.parametrize("weights", [None, "rows", "steps"])
@pytest.mark.parametrize("replicas", [1, 3])
def test_grouped_batches_equal_per_batch_ones(shuffle, carry_mask, weights, replicas):
    rng = np.random.default_rng(1)
    n = 203  # A last batch of 11 real rows of 16 (18 static rows over 3 replicas).
    x = {"a": rng.normal(size=(n, 5)).astype("float32"), "b": rng.integers(0, 9, (n, 2, 3))}
    y = rng.normal(size=(n, 4)).astype("float32")
    sw = {None: None, "rows": rng.random(n), "steps": rng.random((n, 4))}[weights]

    def pipeline(preprocess):
        batches = ArrayBatches(
            x, y, sw, batch_size=16, num_replicas=replicas, shuffle=shuffle, seed=7
        )
        batches.epoch = 3
        return tfdata.array_pipeline(batches, carry_mask, preprocess)

    _assert_same(pipeline(None), pipeline(_identity))


@pytest.mark.parametrize("carry_mask", [True, False])
def test_grouped_batches_without_targets_and_strings(carry_mask):
    n = 37
    x = (np.array([f"row {i}" for i in range(n)]), np.arange(n * 2).reshape(n, 2) > 30)

    def pipeline(preprocess):
        batches = ArrayBatches(x, batch_size=8, num_replicas=1, shuffle=True, seed=2)
        return tfdata.array_pipeline(batches, carry_mask, preprocess)

    _assert_same(pipeline(None), pipeline(_identity))


def test_groups_stay_small_for_large_batches():
    leaves = (tf.zeros([10, 32, 32, 3]), tf.zeros([10, 10]), None)
    assert tfdata._group_size(leaves, 128, 400) == 2  # 128 rows of 12 KiB: 1.5 MiB a batch.
    assert tfdata._group_size(leaves, 4096, 400) == 1
    small = (tf.zeros([10, 32]), tf.zeros([10, 10]), None)
    assert tfdata._group_size(small, 64, 1024) == tfdata._GROUP_LIMIT
    assert tfdata._group_size(small, 64, 5) == 5


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_the_pipeline_and_the_row_groups_hold_every_backends_batches(shuffle, weights):
    """One row order on every backend and every route: the tf.data pipeline's batches and
    the groups one program gathers itself (`RowGroups`' positions, `gather_group`) are
    `ArrayBatches.batch()`'s, epoch after epoch (the order a function of the seed and the
    epoch)."""
    from keras_accel.data.batching import element
    from keras_accel.data.groups import GROUP_REAL, GROUP_ROWS, GROUP_STEPS, RowGroups

    rng = np.random.default_rng(2)
    n = 45  # 6 batches of 8, the last of 5 real rows.
    x, y = rng.normal(size=(n, 3)).astype("float32"), rng.integers(0, 4, (n, 2))
    sw = rng.random(n) if weights else None
    batches = ArrayBatches(x, y, sw, batch_size=8, num_replicas=1, shuffle=shuffle, seed=4)
    pipeline = tfdata.array_pipeline(batches)
    groups, arrays = RowGroups(batches, 4), tfdata.host_arrays(batches)
    for epoch in (0, 1):
        batches.epoch = epoch
        want = [element(batches.batch(i), True, None) for i in range(len(batches))]
        for got, expected in zip(_elements(pipeline), want):
            for u, v in zip(tf.nest.flatten(got), tf.nest.flatten(expected)):
                np.testing.assert_array_equal(u, v)
        for first in (0, 4):
            group = next(groups)
            count = min(4, len(batches) - first)
            assert group[GROUP_STEPS] == count
            stacked = tfdata.gather_group(
                arrays, tf.constant(group[GROUP_ROWS]), tf.constant(group[GROUP_REAL]), 4
            )
            for slot in range(count):  # (Missing slots are never run.)
                got = [leaf[slot].numpy() for leaf in tf.nest.flatten(stacked)]
                expected = tf.nest.flatten(want[first + slot])
                for u, v in zip(got, expected):
                    assert u.dtype == v.dtype
                    np.testing.assert_array_equal(u, v)
        batches.on_epoch_end()
    if shuffle:  # Another epoch, another order.
        assert not np.array_equal(batches.epoch_indices(0), batches.epoch_indices(1))


def test_an_epochs_iterator_is_made_only_when_read(monkeypatch, backend, num_devices):
    """Keras's TF epoch iterator asks for an iterator at each epoch's start and again at its
    end, which the next epoch drops unread; over 8 CPU replicas making one cost about 0.5 s
    (`runtime.Distributed`): only the ones read are made, one per epoch for training and
    one for each validation, and the fit is the one it was."""
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("runtime.Distributed is TensorFlow's, over several replicas: the TF run has it")
    import keras
    from tensorflow.python.data.ops import multi_device_iterator_ops as ops

    from keras_accel import Accelerator

    made = []
    init = ops.OwnedMultiDeviceIterator.__init__

    def counted(self, *args, **kwargs):
        if kwargs.get("components") is None:  # Made, not rebuilt in a traced step.
            made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(ops.OwnedMultiDeviceIterator, "__init__", counted)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 3)).astype("float32"), rng.normal(size=(48, 1)).astype("float32")
    acc = Accelerator(seed=0)

    def build():
        with acc.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            model.compile("sgd", "mse")
        return model

    history = acc.fit(build(), x[:32], y[:32], batch_size=16, epochs=3, verbose=0,
                      validation_data=(x[32:], y[32:]))  # fmt: skip
    assert len(made) == 3 + 3
    assert len(history.history["val_loss"]) == 3
    made.clear()  # Steps per epoch given: Keras reads on where the last epoch stopped.
    acc.fit(build(), x[:32], y[:32], batch_size=16, epochs=4, steps_per_epoch=1, verbose=0)
    assert len(made) == 2  # Two epochs of one step per pass of two batches.
