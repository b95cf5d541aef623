"""What keras_accel's own Keras data adapters share.

Keras's `get_data_adapter` takes any `DataAdapter` as it is, which is how an input of ours
reaches Keras's trainers with what Keras's own adapters cannot give: a fresh pass of a
Grain data set every epoch (`keras_accel.data.grain`), batches placed on the devices one
step ahead (`keras_accel.data.ahead`), a distributed data set counted in global batches
(`keras_accel.adapter.backends.tensorflow`). Their batches are already made and padded to
one static size, so none has a partial batch, and a step's batch size is the batch's.
"""

from __future__ import annotations

import itertools

from keras_accel.data.batching import unpack
from keras_accel.utils import keras_internals


class PaddedBatchesAdapter(keras_internals.data_adapter_class()):
    """A Keras `DataAdapter` over batches padded to one static size. A subclass gives the
    iterators its backend reads and `num_batches`; the others say what it feeds."""

    feeds = "one backend's trainer"  # For the error of an iterator it does not give.

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} feeds {self.feeds} only.")

    get_numpy_iterator = get_tf_dataset = get_jax_iterator = _unsupported
    get_torch_dataloader = _unsupported

    @staticmethod
    def jax_batches(iterator, super_batch=None):
        """What Keras's JAX trainer asks `get_jax_iterator(super_batch=N)` for: from Keras
        3.16 on, with `steps_per_execution=N` > 1 it runs N steps in one compiled scan over
        N batches stacked on a new leading axis (the last, short group as a list). Stacked
        here with Keras's own function, as its PyDataset adapter does, but numpy batches on
        the host (one transfer per group; `jnp.stack` converts each batch on its own); earlier
        Keras passes nothing and gets the batches one by one."""
        if not super_batch:
            return iterator
        return keras_internals.super_batch_iterator()(
            _same_rows_in_groups(iterator, super_batch), super_batch, stack_fn=_stack
        )

    @property
    def batch_size(self):
        return None  # As for a generator: the step's batch size is the padded batch's.

    @property
    def has_partial_batch(self):
        return None  # Every batch is padded to the static size.

    @property
    def partial_batch_size(self):
        return None


class DatasetPasses(PaddedBatchesAdapter):
    """A data adapter over `dataset` (a `keras_accel.data.pydataset.StaticBatchDataset`)
    whose epochs are the dataset's: a pass is its `num_batches` batches, and
    `on_epoch_end` advances it, as Keras's own PyDataset adapter does
    (`keras_accel_ends_epochs`). A subclass gives the iterator its backend reads."""

    keras_accel_ends_epochs = True  # `Accelerator.fit` must not advance the epochs too.

    def __init__(self, dataset):
        self.dataset = dataset

    def keras_accel_first_batch(self):
        # What `Accelerator` builds the model from (`_first_batch`).
        return unpack(self.dataset[0])

    @property
    def keras_accel_indexed_batches(self):
        # The dataset's, read by position: an epoch may begin late (`data.start`).
        return getattr(self.dataset, "keras_accel_indexed_batches", None)

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()

    @property
    def num_batches(self):
        return self.dataset.num_batches


def _same_rows_in_groups(iterator, size: int):
    """`iterator`'s batches, each group of `size` (the ones Keras stacks) brought to one row
    count (`same_rows`): batches of a stream that grew sit in different buckets. Keras's
    `stack_fn` sees one leaf at a time, where a padding row's inputs (copies of a real row)
    and its weight and mask (0) cannot be told apart; here whole batches are."""
    from keras_accel.data.batching import same_rows

    iterator = iter(iterator)
    while True:
        group = list(itertools.islice(iterator, size))
        if not group:
            return
        yield from same_rows(group)


def _stack(leaves):
    """Batches' leaves on a new leading axis: numpy where they are numpy, else on the
    devices where they lie."""
    import numpy as np

    if all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return np.stack(leaves)
    import jax.numpy as jnp

    return jnp.stack(leaves)
