"""When a backup is due: the training batches counted across epochs (Keras numbers them per
epoch) against `save_freq` ("epoch", a number of batches, or False), and the backup's number
for a training position."""

from __future__ import annotations

import math


def check_save_freq(save_freq) -> None:
    """ "epoch", a positive number of batches, or False (Keras's wording first)."""
    if not (
        save_freq == "epoch"
        or save_freq is False
        or (isinstance(save_freq, int) and not isinstance(save_freq, bool) and save_freq > 0)
    ):
        raise ValueError(
            "Invalid value for argument `save_freq`. "
            f"Received: save_freq={save_freq!r}. "
            "Expected either 'epoch' or an integer value: a positive number of batches "
            "(or False, to save only when `save()` is called)."
        )


def counts_batches(save_freq) -> bool:
    """Whether `save_freq` is a number of batches (not "epoch", not False)."""
    return isinstance(save_freq, int) and save_freq is not False


def fusion_period(save_freq, kind: str, steps: int | None) -> int | None:
    """With `save_freq=N` every group of fused steps must end where a backup falls, so
    groups divide N and the epoch (`keras_accel.adapter.protocol`'s `fusion_period`)."""
    if kind != "train" or not counts_batches(save_freq):
        return None
    return math.gcd(save_freq, steps) if steps else save_freq


def step_of(epoch: int, batch: int, steps_per_epoch: int | None, steps_done: int) -> int:
    """One backup per training position, numbered by it: the steps done (the same as
    epoch * steps + batch when the epoch length is known, which a direct call uses)."""
    if steps_per_epoch:
        return int(epoch) * int(steps_per_epoch) + int(batch)
    return int(steps_done)


class Schedule:
    """The training batches done, counted across epochs, and the count at the last backup."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps_done = 0  # Training batches done, counted across epochs.
        self.last_saved = 0
        self.at_epoch_end = False  # A backup fell on the epoch's last batch: saved at its end.
        self._last_batch, self._batch_epoch = -1, None

    def count(self, epoch: int, batch: int) -> None:
        """Batch `batch` of `epoch` ended (a fused group counts all of its batches)."""
        previous = self._last_batch if epoch == self._batch_epoch else -1
        self.steps_done += batch - previous
        self._last_batch, self._batch_epoch = batch, epoch

    def due(self, save_freq) -> bool:
        """Whether `save_freq` batches went by since the last backup."""
        return counts_batches(save_freq) and self.steps_done - self.last_saved >= save_freq

    def saved(self) -> None:
        self.last_saved = self.steps_done

    def resume(self, steps_done: int, epoch: int, batch: int) -> None:
        """Restored at `batch` batches into `epoch`, after `steps_done` batches in all."""
        self.steps_done = self.last_saved = int(steps_done)
        self._last_batch, self._batch_epoch = batch - 1, epoch
