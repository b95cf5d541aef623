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
"""

from __future__ import annotations

import keras
import numpy as np

from keras_accel.data.adapters import DatasetPasses

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


class TorchBatches(DatasetPasses):
    """`dataset` (a `keras_accel.data.pydataset.StaticBatchDataset` over arrays) as a Keras
    data adapter whose torch iterator yields each batch as torch tensors (see the module
    docstring). Epochs are the dataset's, advanced by `on_epoch_end` as Keras's PyDataset
    adapter advances them (`keras_accel_ends_epochs`)."""

    feeds = "the torch trainer"

    def get_torch_dataloader(self):
        return self._pass()

    def _pass(self):
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

        for index in range(self.dataset.num_batches):
            yield keras.tree.map_structure(convert, self.dataset[index])
