"""An epoch that begins part-way: where a resumed `fit` starts at the batch its backup was
taken at, instead of running the epoch's first batches again (`keras_accel.callbacks.
BackupAndRestore`).

Batches read by index (`ArrayBatches`, `PyDatasetBatches`: `StartsLate`) are told the epoch
and the batch to begin at; while that epoch is theirs, position `i` of it serves batch
`i + skipped` and the epoch is `skipped` batches shorter, so every reader that walks an
epoch by position (the Keras adapters over them) reads batches `skipped..` and nothing
before. The epoch's order stays the function of the seed and the epoch it always was.
`start_at` says which of what `fit` is fed reads its batches that way.
"""

from __future__ import annotations


class StartsLate:
    """For batches read by index with an `epoch` (the epoch whose batches they serve)."""

    _begin: tuple[int, int] | None = None  # (epoch, first batch) of an epoch begun late.

    def begin_epoch_at(self, epoch: int, batch: int) -> None:
        """Epoch `epoch` serves batches `batch..` only (its positions count from there)."""
        self._begin = (int(epoch), int(batch))

    @property
    def skipped(self) -> int:
        """The batches the current epoch leaves out at its start (0 but in a late one)."""
        begin = self._begin
        return begin[1] if begin is not None and begin[0] == self.epoch else 0


def indexed_batches(fed):
    """The batches that `fed` (what `fit` is given: a Keras data adapter or PyDataset of
    ours) reads by position in its epoch, which can begin an epoch late; None for anything
    else (a stream, a tf.data input), which cannot. A feed says so with its
    `keras_accel_indexed_batches`."""
    batches = getattr(fed, "keras_accel_indexed_batches", None)
    return batches if isinstance(batches, StartsLate) else None


def start_at(fed, epoch: int, batch: int) -> bool:
    """Have `fed` begin `epoch` at `batch` (0 < `batch` < the epoch's batches); False where
    it cannot, which changes nothing."""
    batches = indexed_batches(fed)
    total = None if batches is None else batches.plan.num_batches
    if not total or not 0 < batch < total:
        return False
    batches.begin_epoch_at(epoch, batch)
    return True
