"""Static-size batches over arrays (`ArrayBatches`): in-memory numpy arrays, memory maps and
array-likes on disk, batched, shuffled by epoch and padded here, one batch (or one group of
batches) at a time, so the data set is never copied whole.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from keras_accel.data import on_disk
from keras_accel.data.batching import (
    BatchPlan,
    check_same_length,
    flatten,
    map_structure,
    pad_batch,
    static_batch_size,
)
from keras_accel.data.class_weights import check_class_weight, class_weights_to_sample_weights
from keras_accel.data.inputs import standardize_sample_weight, to_numpy
from keras_accel.data.start import StartsLate


class ArrayBatches(StartsLate):
    """Static-size batches over arrays, gathered one batch at a time: in-memory numpy
    arrays, and memory maps and array-likes on disk (`keras_accel.data.on_disk`), read
    from the disk a batch of rows at a time (`on_disk`: whether any array is). An epoch
    begun late (`begin_epoch_at`, a resume) serves its batches from there: position `i`
    of it is batch `i + skipped`."""

    reads_rows = True  # `batch(rows=...)` reads one process's rows alone.

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        batch_size: int,
        num_replicas: int,
        shuffle: bool = False,
        remainder: str = "pad",
        training: bool = True,
        seed: int | None = None,
        class_weight: dict | None = None,
    ):
        # A read-only memory map mapped again copy-on-write: its batches can be shared with
        # a tensor a step may write to, as in-memory ones are (`on_disk.copy_on_write`).
        x = map_structure(on_disk.copy_on_write, to_numpy(x, "x"))
        y = map_structure(on_disk.copy_on_write, to_numpy(y, "y"))
        sample_weight = map_structure(
            on_disk.copy_on_write, standardize_sample_weight(sample_weight)
        )
        num_samples = check_same_length([("x", x), ("y", y), ("sample_weight", sample_weight)])
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError(
                    "Pass either `class_weight` or `sample_weight`, not both. "
                    f"Received: class_weight={class_weight} and a sample_weight array."
                )
            if on_disk.on_disk(y):
                # Targets on disk: each batch's weights from its own targets, when it is read.
                check_class_weight(class_weight)
                sample_weight = on_disk.MappedRows(
                    y, lambda rows: class_weights_to_sample_weights(rows, class_weight), "float32"
                )
            else:
                sample_weight = class_weights_to_sample_weights(y, class_weight)
        self.x, self.y, self.sample_weight = x, y, sample_weight
        # Whether any array is a memory map or an array-like on disk: then every batch is
        # read from the host, never the arrays whole (`keras_accel.data.on_disk`).
        self.on_disk = any(
            on_disk.on_disk(a) for a in flatten((x, y, sample_weight)) if a is not None
        )
        self._made_targets = self._made_weights = False
        self.plan = BatchPlan(
            num_samples=num_samples,
            batch_size=int(batch_size),
            static_rows=static_batch_size(batch_size, num_replicas),
            remainder=remainder,
            training=training,
        )
        self.shuffle = shuffle
        # Without a seed, draw one now: each epoch's order must be one fixed function of the
        # epoch, since batches of an epoch may be gathered from several threads.
        self.seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else seed
        self._epoch = 0
        self.epoch_listeners: list = []  # Pipelines that compute the order in a graph.
        self._order_epoch = None
        self._order = None
        self._lock = threading.Lock()

    @property
    def has_targets(self) -> bool:
        return self.y is not None or self._made_targets

    @has_targets.setter
    def has_targets(self, value: bool) -> None:
        # Set where preprocessing makes targets from x (`keras_accel.adapter.pipeline`).
        self._made_targets = bool(value) and self.y is None

    @property
    def weighted(self) -> bool:
        """Whether the batches carry weights: the user's (sample_weight or class_weight),
        or ones their preprocessing makes."""
        return self.sample_weight is not None or self._made_weights

    @weighted.setter
    def weighted(self, value: bool) -> None:
        self._made_weights = bool(value) and self.sample_weight is None

    def __len__(self) -> int:
        return self.plan.num_batches - self.skipped

    @property
    def batch_bytes(self) -> int:
        """Bytes of one padded batch of the arrays (x, y and sample_weight): what each step
        of a fused group holds (`fusion.choose` bounds a group's by it)."""
        total = 0
        for a in flatten((self.x, self.y, self.sample_weight)):
            if a is not None and getattr(a, "shape", None) is not None:
                total += int(np.prod(a.shape[1:], dtype=np.int64)) * np.dtype(a.dtype).itemsize
        return total * self.plan.static_rows

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """Row order of `epoch`: a pure function of (seed, epoch), so a resumed run sees the
        same order as an uninterrupted one."""
        with self._lock:
            if self._order_epoch != epoch:
                self._order = self.plan.permutation(self.seed, epoch, self.shuffle)
                self._order_epoch = epoch
            return self._order

    @property
    def epoch(self) -> int:
        """The epoch whose row order `batch()` serves."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._epoch = int(value)
        for listener in self.epoch_listeners:
            listener(self._epoch)

    def on_epoch_end(self) -> None:
        self.epoch += 1

    def batch(
        self,
        index: int,
        epoch: int | None = None,
        scale: bool = False,
        rows: slice | None = None,
    ) -> tuple[Any, Any, Any, Any]:
        """Padded batch `index` of `epoch` (default: the current `self.epoch`):
        `(x, y, sample_weight, row_mask)`. `scale=True` weights it for a plain `model.fit`
        (`BatchPlan.weight_scales`). `rows` (a slice of the padded batch's positions): only
        those rows of it, read without the others (one process's share of a global batch),
        the same rows, weights and mask as the whole batch's `[rows]`."""
        # Without `epoch`: a position in the current epoch, which may have begun late.
        count = len(self) if epoch is None else self.plan.num_batches
        if not 0 <= index < count:
            raise IndexError(f"batch index {index} out of range for {count} batches")
        if epoch is None:
            index += self.skipped
        plan = self.plan
        real = int(plan.real_rows[index])
        first, stop, size = 0, real, plan.batch_rows(index)
        if rows is not None:
            first, stop, size = min(rows.start, real), min(rows.stop, real), rows.stop - rows.start
        start = index * plan.batch_size
        take = self._reader(self.epoch if epoch is None else epoch, start + first, start + stop)
        sw = None if self.sample_weight is None else take(self.sample_weight)
        factor = plan.weight_scales[index] if scale else 1.0
        return pad_batch(map_structure(take, self.x), map_structure(take, self.y), sw, size, factor)

    def _reader(self, epoch: int, begin: int, end: int):
        """`take(array)` -> the rows at places `begin` to `end - 1` of `epoch`'s order."""
        if not self.shuffle:
            # Contiguous rows are sliced, not gathered: a view of an in-memory array, not a
            # copy (`on_disk.read_range`).
            return lambda a: on_disk.read_range(a, begin, end)
        indices = self.epoch_indices(epoch)[begin:end]
        return lambda a: on_disk.read_rows(a, indices)

    def group(self, first: int, count: int) -> tuple[Any, Any, Any, Any]:
        """Padded batches `first` to `first + count - 1` of the current epoch stacked on a
        new first axis: the arrays `np.stack` of their `batch()` gives, gathered in one
        `take` per array where every one of them is full (no padding), as an epoch's
        batches are but for the last, else written batch by batch into the stacked arrays
        (never a list of the batches beside them)."""
        plan = self.plan
        first += self.skipped
        real = plan.real_rows[first : first + count]
        if not (len(real) == count and (real == plan.static_rows).all()):
            epoch = self.epoch  # Batches of the whole epoch, by their place in it.
            return _stacked((self.batch(i, epoch) for i in range(first, first + count)), count)
        rows = plan.batch_size  # Full batches: as many rows as the static size.
        read = self._reader(self.epoch, first * rows, (first + count) * rows)

        def take(a):
            a = read(a)
            if not a.flags.owndata:  # A view of the arrays: copied, as stacking copied it.
                a = np.array(a)
            return a.reshape((count, rows) + a.shape[1:])

        weights = (
            np.ones((count, rows), "float32")
            if self.sample_weight is None
            else take(self.sample_weight).astype("float32") * np.float32(1.0)
        )
        mask = np.ones((count, rows), "float32")
        return map_structure(take, self.x), map_structure(take, self.y), weights, mask


def _stacked(batches, count: int) -> Any:
    """`count` batches of one structure (an iterable) as that structure, each array the
    batches' arrays stacked: written one batch at a time into arrays made for the whole
    stack, so that only one batch is held beside it."""
    stacked = None
    for slot, batch in enumerate(batches):
        if stacked is None:
            stacked = _empty_stack(batch, count)
        _write(stacked, batch, slot)
    return stacked


def _empty_stack(batch: Any, count: int) -> Any:
    if batch is None:
        return None
    if isinstance(batch, dict):
        return {key: _empty_stack(value, count) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_stack(item, count) for item in batch)
    batch = np.asarray(batch)
    return np.empty((count,) + batch.shape, batch.dtype)


def _write(stacked: Any, batch: Any, slot: int) -> None:
    if stacked is None:
        return
    if isinstance(stacked, dict):
        for key, value in stacked.items():
            _write(value, batch[key], slot)
    elif isinstance(stacked, (list, tuple)):
        for out, item in zip(stacked, batch):
            _write(out, item, slot)
    else:
        stacked[slot] = batch
