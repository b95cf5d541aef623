"""A `keras.utils.PyDataset` view of static-size batches: what `model.fit` takes on any backend."""

from __future__ import annotations

import keras

from keras_accel.data.batching import map_structure, pack


class StaticBatchDataset(keras.utils.PyDataset):
    """Serves `batches.batch(i)`; `on_epoch_end` advances the batches to the next epoch.

    With `carry_mask=True` (what the Accelerator feeds its own step wrappers) a batch is
    `(x, y, (sample_weight, row_mask))`; with False (`Accelerator.dataset`, for a plain
    `model.fit`) it is Keras's `(x, y, sample_weight)`, padding rows weighted 0. Without
    targets it is `(x,)` either way.

    `rows` (a slice of each global batch) serves only this process's rows of a multi-process
    run: every process computes the same global batch (same order, same padding), then keeps
    the rows that its devices hold.
    """

    def __init__(self, batches, carry_mask: bool = True, workers: int = 1, rows=None):
        # A thread prefetches the next batches while the device computes the current one.
        super().__init__(workers=workers, use_multiprocessing=False, max_queue_size=4)
        self.batches = batches
        self.carry_mask = carry_mask
        self.rows = rows

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        x, y, sample_weight, row_mask = self.batches.batch(index)
        if self.rows is not None:
            x, y, sample_weight, row_mask = map_structure(
                lambda a: a[self.rows], (x, y, sample_weight, row_mask)
            )
        if y is None:
            return (x,)
        if not self.carry_mask:
            return x, y, sample_weight
        return pack(x, y, sample_weight, row_mask)

    def on_epoch_end(self) -> None:
        self.batches.on_epoch_end()
