"""A `keras.utils.PyDataset` view of static-size batches: what `model.fit` takes on any backend."""

from __future__ import annotations

import keras


class StaticBatchDataset(keras.utils.PyDataset):
    """Serves `batches.batch(i)`; `on_epoch_end` advances the batches to the next epoch.

    Yields `(x, y, sample_weight)`, or `(x,)` for inputs without targets (prediction), so that
    padding rows are always identifiable by their zero weight where a loss is computed.
    """

    def __init__(self, batches, workers: int = 1):
        # A thread prefetches the next batches while the device computes the current one.
        super().__init__(workers=workers, use_multiprocessing=False, max_queue_size=4)
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        x, y, sample_weight = self.batches.batch(index)
        if y is None:
            return (x,)
        return x, y, sample_weight

    def on_epoch_end(self) -> None:
        self.batches.on_epoch_end()
