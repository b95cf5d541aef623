"""Batches placed on the devices one step ahead (JAX): the next batch's transfer overlaps the
current step.

Keras's JAX trainer looks one batch ahead only without a distribution, and only off the CPU
(`JAXEpochIterator._one_batch_ahead_iterator`); under a `keras.distribution` it places each
batch when the step asks for it, so on an accelerator the transfer waits for the host. Here
an indexed input (in-memory arrays, a user's `PyDataset`) reaches Keras as `OneBatchAhead`, a
Keras `DataAdapter` (Keras's `get_data_adapter` takes one as it is): when the step takes
batch k, batch k + 1 has been gathered and its (asynchronous) transfer to the devices has
begun, laid out as the step wants it (`place`: the distribution's data layout), so Keras's
own placement of it is a no-op. On several devices of any platform (so that the suite's 8
virtual CPU devices run what GPUs run) and on one accelerator; not on one CPU device, where
Keras does not look ahead either, and where it measured about 5% slower. The cost is one
more batch held. No thread: the gathering order, the epochs' row orders and the reads of a
user's `PyDataset` are those of the synchronous path, one batch earlier.
"""

from __future__ import annotations

import itertools

from keras_accel.data.adapters import DatasetPasses


class OneBatchAhead(DatasetPasses):
    """`dataset` (a `keras_accel.data.pydataset.StaticBatchDataset`) as a Keras data adapter
    whose JAX iterator places each batch with `place` one batch before it is asked for.

    Epochs are the dataset's: a pass is its `num_batches` batches (endless without a
    length, ended by `steps_per_epoch`), and `on_epoch_end` advances it, as Keras's own
    PyDataset adapter does (`keras_accel_ends_epochs`). A batch gathered ahead under one
    epoch's row order and asked for in the next (an iterator Keras keeps across epochs under
    `steps_per_epoch`) is gathered again, so every batch has the order the synchronous path
    gives it.
    """

    def __init__(self, dataset, place):
        super().__init__(dataset)
        self.place = place

    def _epoch(self):
        return getattr(self.dataset.batches, "epoch", None)

    def _gather(self, index: int):
        return self._epoch(), self.place(self.dataset[index])

    def _pass(self):
        count = self.dataset.num_batches
        indices = itertools.count() if count is None else range(count)
        pending = None  # (index, epoch, placed batch)
        for index in indices:
            try:
                epoch, batch = self._gather(index)
            except Exception:
                if pending is not None:  # The error belongs to the next step, not this one.
                    yield self._current(pending)
                raise
            if pending is not None:
                yield self._current(pending)
            pending = (index, epoch, batch)
        if pending is not None:
            yield self._current(pending)

    def _current(self, pending):
        index, epoch, batch = pending
        if epoch != self._epoch():  # Gathered in an epoch that has ended since.
            return self._gather(index)[1]
        return batch

    feeds = "the JAX trainer"

    def get_jax_iterator(self, super_batch=None):
        return self.jax_batches(self._pass(), super_batch)
