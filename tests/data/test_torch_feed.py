"""In-memory arrays fed to Keras's torch trainer without its DataLoader
(`keras_accel.data.torch_feed.TorchBatches`, what `acc.fit` gives Keras's torch trainer for
arrays): each batch is the tensor Keras's own PyDataset path makes, in the same order, epoch
after epoch."""

import keras
import numpy as np
import pytest

from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.pydataset import StaticBatchDataset
from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="feeds Keras's torch trainer"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def _batches():
    rows = 37  # A last batch of 5 real rows, padded.
    x = {
        "dense": np.random.RandomState(0).randn(rows, 3),  # float64 stays float64.
        "ids": np.arange(rows * 2, dtype="uint32").reshape(rows, 2),  # Keras widens uint32.
        "flag": np.arange(rows) % 3 == 0,
    }
    y = np.arange(rows, dtype="int64")
    return ArrayBatches(x, y, batch_size=8, num_replicas=1, shuffle=True, seed=0, training=True)


def _epochs(make_iterator, adapter, epochs=2):
    seen = []
    for _ in range(epochs):
        adapter.on_epoch_begin()
        seen.append(list(make_iterator()))
        adapter.on_epoch_end()
    return seen


def test_batches_are_the_tensors_of_keras_pydataset_path_in_its_order():
    import torch

    from keras_accel.data.torch_feed import TorchBatches
    from keras_accel.utils import keras_internals

    ours = TorchBatches(StaticBatchDataset(_batches()))
    keras_adapter = keras_internals.get_data_adapter()(StaticBatchDataset(_batches()))
    mine = _epochs(ours.get_torch_dataloader, ours)
    theirs = _epochs(keras_adapter.get_torch_dataloader, keras_adapter)
    assert ours.num_batches == 5 and [len(e) for e in mine] == [5, 5]
    # The two epochs' row orders differ (shuffled), and match Keras's path batch for batch.
    assert not torch.equal(mine[0][0][1], mine[1][0][1])
    for epoch_mine, epoch_theirs in zip(mine, theirs):
        for a, b in zip(epoch_mine, epoch_theirs):
            flat_a, flat_b = keras.tree.flatten(a), keras.tree.flatten(b)
            assert len(flat_a) == len(flat_b)
            for u, v in zip(flat_a, flat_b):
                assert isinstance(u, torch.Tensor) and u.dtype == v.dtype, (u.dtype, v.dtype)
                assert u.device == v.device and torch.equal(u, v)
    dtypes = {u.dtype for u in keras.tree.flatten(mine[0][0])}
    assert {torch.float64, torch.int64, torch.bool} <= dtypes
