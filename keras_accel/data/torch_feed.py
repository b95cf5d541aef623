"""In-memory arrays fed to Keras's torch trainer as torch tensors, without its DataLoader.

Keras's torch trainer reads an indexed input through a `torch.utils.data.DataLoader` over
its PyDataset adapter: each batch goes through the DataLoader's fetch, a queue from the
PyDataset's worker thread, and `convert_to_tensor` on every leaf (dtype lookups, a tree
map), about 0.25 ms per step on a CPU, a third of a small model's whole compiled step
(docs/benchmarks.md). A batch of in-memory arrays is gathered in tens of microseconds, so
here it is gathered in the trainer's thread, when the step asks for it, and handed over as
the tensor Keras's conversion would make (`torch.as_tensor` with the array's own dtype,
on Keras's device; shared memory on the CPU, as Keras's is). The batches, their order and
the epochs' row orders are the PyDataset's: `StaticBatchDataset` serves them as before.

torch's global generator is drawn from as Keras's DataLoader draws from it, though no
DataLoader runs: an unseeded `Dropout` on Keras's torch backend
(`torch.nn.functional.dropout`) draws its mask from that generator, so a draw the data path
adds or leaves out changes every mask after it. Keras's array DataLoader draws one int64
each time an iterator of it is made (its base seed, `_BaseDataLoaderIter.__init__`), and,
shuffling, one more as its first batch is read (`RandomSampler`'s seed; with
`shuffle="batch"`, a `torch.randperm` of each batch's rows as it is read). Keras's epoch
iterator makes an iterator at each epoch's start and another at its end (each evaluation's
and prediction's alike), and its `_symbolic_build` one more when it builds a model from the
data. `TorchLoader` draws the same, at the same moments (`draw_as_keras_reads`: for the
build, which the Accelerator makes from the batch it has already).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_accel.data.adapters import DatasetPasses
from keras_accel.data.pydataset import StaticBatchDataset

# numpy dtypes whose tensor Keras's torch `convert_to_tensor` makes with the same dtype
# (`torch.as_tensor(x, dtype=..., device=...)`); any other (uint32, which Keras widens;
# bfloat16; strings) goes through Keras's own conversion.
_SAME_DTYPE = frozenset(
    np.dtype(name)
    for name in (
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "bool",
    )
)


def draw_as_an_iterator_is_made() -> None:
    """What making an iterator of Keras's torch DataLoader draws from torch's global
    generator: the base seed of `_BaseDataLoaderIter.__init__` (a DataLoader without a
    generator of its own, as Keras's are)."""
    import torch

    torch.empty((), dtype=torch.int64).random_()


def draw_as_keras_reads(adapter) -> None:
    """What Keras's `_symbolic_build` draws from torch's global generator where it reads the
    first batch of `adapter` (it makes an iterator of the adapter's DataLoader and reads one
    batch): the Accelerator builds the model from the batch it has already, so only the
    draws are made. Keras's own adapters (a PyDataset's, a generator's, tf.data's) are read
    through a real DataLoader over an `IterableDataset`: its iterator is made (its own
    draw), no batch read (which draws nothing)."""
    if isinstance(adapter, TorchBatches):
        iterator = iter(adapter.get_torch_dataloader())
        iterator.draw_first_read()
        return
    try:
        loader = adapter.get_torch_dataloader()
    except NotImplementedError:
        return
    import torch

    if isinstance(loader, torch.utils.data.DataLoader):
        iter(loader)


class TorchBatches(DatasetPasses):
    """`dataset` (a `keras_accel.data.pydataset.StaticBatchDataset` over arrays) as a Keras
    data adapter whose torch iterator yields each batch as torch tensors (see the module
    docstring). Epochs are the dataset's, advanced by `on_epoch_end` as Keras's PyDataset
    adapter advances them (`keras_accel_ends_epochs`)."""

    feeds = "the torch trainer"

    def get_torch_dataloader(self):
        return TorchLoader(self)

    @property
    def shuffle(self):
        """How plain Keras's DataLoader would shuffle these batches' rows: `fit`'s `shuffle`
        (False for evaluation and prediction, whose batches never shuffle)."""
        return getattr(self.dataset.batches, "shuffle", False)

    def real_rows(self, index: int) -> int:
        """The real rows of global batch `index`: the rows of Keras's batch."""
        return int(self.dataset.batches.plan.real_rows[index])

    def one_pass(self, draws):
        """The batches of one pass as torch tensors, `draws(index)` called as each is read
        (what Keras's sampler draws then: `_LoaderIterator`)."""
        import torch

        # Keras's device now (a `keras.device` scope around the call counts), read as
        # Keras's conversion reads it.
        device = keras.ops.convert_to_tensor(0).device

        def convert(leaf):
            if isinstance(leaf, np.ndarray) and leaf.dtype in _SAME_DTYPE:
                if not leaf.flags.writeable:
                    # A view of a read-only memory map (a batch of rows in order): torch
                    # shares no read-only memory (it warns, and a step may write to it).
                    leaf = np.array(leaf)
                return torch.as_tensor(leaf, device=device)
            return None if leaf is None else keras.ops.convert_to_tensor(leaf)

        # An epoch begun late (a resume) draws as the rest of its epoch would.
        skipped = getattr(self.dataset.batches, "skipped", 0)
        for index in range(self.dataset.num_batches):
            draws(index + skipped)
            yield keras.tree.map_structure(convert, self.dataset[index])
        if skipped:
            # Keras ends an epoch of known length after its last batch by making the next
            # iterator at once (a draw); one begun late ends where its data does, without.
            draw_as_an_iterator_is_made()


class TorchLoader:
    """What `TorchBatches.get_torch_dataloader` returns: an iterable whose iterators draw
    from torch's global generator what the iterators of Keras's DataLoader over the same
    arrays draw (see the module docstring), and serve the batches."""

    def __init__(self, batches: TorchBatches):
        self.batches = batches

    def __iter__(self):
        return _LoaderIterator(self.batches)


class _LoaderIterator:
    def __init__(self, batches: TorchBatches):
        self.batches = batches
        draw_as_an_iterator_is_made()  # Made: the base seed, before any batch is read.
        self._batches = batches.one_pass(self._draw_for)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._batches)

    def _draw_for(self, index: int) -> None:
        """What Keras's sampler draws as batch `index` is read."""
        import torch

        shuffle = self.batches.shuffle
        if shuffle == "batch":  # Keras's RandomBatchSampler: a permutation of each batch.
            torch.randperm(self.batches.real_rows(index))
        elif shuffle and index == 0:  # Keras's RandomSampler: its seed, as the pass begins.
            torch.empty((), dtype=torch.int64).random_()

    def draw_first_read(self) -> None:
        """The draws of reading the first batch, without reading it."""
        self._draw_for(0)


class KerasReadDataset(StaticBatchDataset):
    """A `StaticBatchDataset` that Keras's torch trainer reads through its own PyDataset
    adapter and DataLoader (a user's PyDataset): an epoch begun late (a resume) ends where
    its data does, without the iterator Keras makes at once after an epoch of known length
    (whose base seed is a draw from torch's global generator, which unseeded Dropout
    reads): drawn here as that epoch ends, in its place."""

    def on_epoch_end(self) -> None:
        if getattr(self.batches, "skipped", 0):
            draw_as_an_iterator_is_made()
        super().on_epoch_end()
