"""Batches of the sources read as they come, each batch padded as it arrives, never counted
first: a `keras.utils.PyDataset`, with or without a length (`PyDatasetBatches`); a Python
generator, a Grain data set or a torch DataLoader (`IterableBatches`). Each batch is padded to
the size of the first batch (rounded up to a multiple of the replica count; a larger batch to
a bucket, `batching.bucket_rows`, noted once per bucket: `note_growth`).

A "batches" object, whatever its input, is backend-free: it has a `plan`
(`keras_accel.data.batching.BatchPlan` where the rows are known, else `StreamPlan`),
`has_targets` and `weighted`, and serves `(x, y, sample_weight, row_mask)` numpy tuples,
unscaled (the step wrappers weight them): by index (`batch(index)`: arrays, PyDataset) or as
one pass (`batches()`: generators, Grain). An `epoch` counter (which `Accelerator.fit` sets at
each epoch's start) makes shuffling a function of the epoch, so a resumed run sees the same
order. `sample_batch` reads the first batch of any of them. The backend modules wrap them in
what `model.fit` takes.

The other inputs' batches have modules of their own, and the names the rest of keras_accel
uses are imported here too, so that `keras_accel.data.sources` stays the one import of an
input's batches: which kind an input is and its numpy form (`keras_accel.data.inputs`),
arrays (`keras_accel.data.array_batches`); a `tf.data.Dataset` (where TensorFlow is
installed) is `keras_accel.data.tfdata`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import numpy as np

from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.batching import (
    UNPADDED,
    StreamPlan,
    bucket_rows,
    num_rows,
    pad_batch,
    static_batch_size,
)
from keras_accel.data.class_weights import class_weighted_batch
from keras_accel.data.inputs import (
    ARRAYS,
    GENERATOR,
    GRAIN,
    PY_DATASET,
    STREAMS,
    SUPPORTED_INPUTS,
    TF_DATASET,
    TORCH_DATALOADER,
    as_numpy_batch,
    classify,
    is_array_input,
    is_generator,
    is_grain_dataset,
    standardize_element,
    to_numpy,
)
from keras_accel.data.start import StartsLate

__all__ = [
    "ARRAYS",
    "GENERATOR",
    "GRAIN",
    "PY_DATASET",
    "STREAMS",
    "SUPPORTED_INPUTS",
    "TF_DATASET",
    "TORCH_DATALOADER",
    "ArrayBatches",
    "IterableBatches",
    "PyDatasetBatches",
    "classify",
    "is_array_input",
    "is_generator",
    "is_grain_dataset",
    "note_growth",
    "refuse_preprocessing",
    "sample_batch",
    "standardize_element",
    "to_numpy",
]


def sample_batch(batches) -> tuple[Any, Any, Any, Any]:
    """The first padded batch of `batches` as numpy: `(x, y, sample_weight, row_mask)`.

    For what has to be known of the data before a step is compiled (which accuracy a
    compiled "accuracy" means; whether a user's loss returns one value per row)."""
    own = getattr(batches, "own_files", None)  # This process's files (several processes).
    if own is not None:
        return own.first_batch()
    if hasattr(batches, "first_batch"):
        return batches.first_batch()
    if hasattr(batches, "batch"):
        return batches.batch(0)
    import keras

    from keras_accel.data.batching import unpack

    element = next(iter(batches.pipeline().take(1)))
    return unpack(keras.tree.map_structure(np.asarray, element))


class _Padder:
    """Pads the batches a user's data set yields, one at a time, as they come.

    Every batch is padded to the static size (the first batch's rows, rounded up to a
    replica multiple) and carries its row mask; one smaller than the first is a partial
    batch: padded, or skipped under remainder="drop" (training only). One larger than the
    static size is padded to the next bucket (`keras_accel.data.batching.bucket_rows`: the
    static size doubled until it fits), as plain Keras takes batches of any size: the step
    is compiled once more for each new bucket (noted once per bucket, `note_growth`)."""

    def __init__(self, first: tuple, *, num_replicas: int, remainder: str, kind: str):
        x0, y0, sw0 = first
        self.first_rows = num_rows(x0)
        if self.first_rows < 1:
            raise ValueError(f"The first batch of the {kind} has no rows.")
        self.has_targets = y0 is not None
        self.weighted = sw0 is not None
        self.static_rows = static_batch_size(self.first_rows, num_replicas)
        self.remainder = remainder
        self.kind = kind

    def check(self, batch: tuple, where: str) -> bool:
        """Whether `batch` is served (False: a partial batch that "drop" skips)."""
        x, y, sw = batch
        rows = num_rows(x)
        if (y is None) != (not self.has_targets) or (sw is None) != (not self.weighted):
            raise ValueError(
                f"{where} of the {self.kind} is {_shape_of(batch)} but its first batch was "
                f"{_shape_of((x, self.has_targets or None, self.weighted or None))}: every "
                "batch must have the same structure."
            )
        return not (self.remainder == "drop" and rows < self.first_rows)

    def pad(self, batch: tuple, scale: bool = False, plan=None, index: int = 0) -> tuple:
        x, y, sw = batch
        rows = num_rows(x)
        if self.remainder == "whole":
            # One replica, for code that cannot weight padding out: every batch as it
            # came, a step compiled for each new size, as plain Keras compiles one.
            return pad_batch(x, y, sw, rows)
        static = bucket_rows(rows, self.static_rows)
        if static != self.static_rows:
            note_growth(self.kind, self.first_rows, rows, self.static_rows, static)
        factor = plan.weight_scale(index, rows, static) if scale else 1.0
        return pad_batch(x, y, sw, static, factor)


# (kind, first static size, bucket) triples this process has noted.
_GROWTH_NOTES: set = set()


def note_growth(kind: str, first_rows: int, rows: int, static_rows: int, bucket: int) -> None:
    """Says once per bucket that a stream's batch outgrew its first batch: a step program
    is compiled for the bucket (the recompile guard names it too after warm-up)."""
    key = (kind, static_rows, bucket)
    if key in _GROWTH_NOTES:
        return
    _GROWTH_NOTES.add(key)
    warnings.warn(
        f"keras_accel: a batch of the {kind} has {rows} rows, more than its first batch "
        f"({first_rows} rows, padded to {static_rows}): it is padded to {bucket} rows, and "
        f"the step is compiled once more for that size (batch sizes up to B cost at most "
        f"1 + log2(B / {static_rows}) compiled steps). Put the largest batch first, or batch "
        "the data with one batch size, to compile once.",
        stacklevel=2,
    )


def _shape_of(batch: tuple) -> str:
    x, y, sw = batch
    parts = ["x"] + (["y"] if y is not None else []) + (["sample_weight"] if sw is not None else [])
    return "(" + ", ".join(parts) + ")"


class PyDatasetBatches(StartsLate):
    """A user's `keras.utils.PyDataset`, every batch padded to one static size as it is read.

    The static size is the first batch's rows rounded up to a replica multiple; any batch
    may be smaller (it is padded, and weighted by its real rows where it is consumed). The
    PyDataset may have no length (`num_batches` None: Keras's infinite PyDataset, ended by
    `steps_per_epoch`). With `shuffle=True` (Keras's default in `fit`) the batch order is a
    new permutation every epoch, as Keras's own PyDataset adapter draws it, here a function
    of (seed, epoch) so that a resumed run sees the same order. Nothing is read in advance
    but the first batch (and, under remainder="drop", the last: whether it is partial).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int,
        remainder: str = "pad",
        training: bool = True,
        shuffle: bool = False,
        seed: int | None = None,
        class_weight: dict | None = None,
    ):
        self.source = dataset
        self.class_weight = class_weight
        count = dataset.num_batches
        if count is not None and count < 1:
            raise ValueError(f"The PyDataset is empty. Received: len(dataset)={count}")
        self._padder = _Padder(
            self._read(0),
            num_replicas=num_replicas,
            remainder=remainder,
            kind="PyDataset",
        )
        self.has_targets = self._padder.has_targets
        self.weighted = self._padder.weighted
        self.count = count
        if remainder == "drop" and count is not None:
            last = count - 1
            if last and num_rows(self._read(last)[0]) < (self._padder.first_rows):
                self.count = count - 1
            self._padder.remainder = "pad"  # Only the last batch may be partial: known now.
        elif remainder == "drop":
            raise ValueError(
                "remainder='drop' needs to know which batch is the last, and this PyDataset "
                "has no length (num_batches=None). Give it a __len__, or use remainder='pad'."
            )
        self.plan = StreamPlan(
            batch_size=self._padder.first_rows,
            static_rows=self._padder.static_rows,
            num_batches=self.count,
            infinite=count is None,
            pads=remainder not in UNPADDED,
            remainder=remainder,
            training=training,
            kind="PyDataset",
        )
        self.shuffle = bool(shuffle) and count is not None
        self._orders: dict = {}
        self.seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else seed
        self.epoch = 0  # Set by Accelerator.fit at each epoch's start.

    @property
    def num_batches(self) -> int | None:
        """The batches of the current epoch (fewer in one begun late: `begin_epoch_at`)."""
        return None if self.count is None else self.count - self.skipped

    def __len__(self) -> int:
        if self.count is None:
            raise TypeError("An infinite PyDataset (num_batches=None) has no length.")
        return self.count - self.skipped

    def source_index(self, index: int) -> int:
        if not self.shuffle:
            return index
        epoch = self.epoch
        order = self._orders.get(epoch)
        if order is None:  # Batches of one epoch may be read from several threads.
            order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
            self._orders = {epoch: order}
        return int(order[index])

    def batch(self, index: int, epoch: int | None = None, scale: bool = False):
        """Padded batch `index` of the current epoch: `(x, y, sample_weight, row_mask)`.
        `scale=True` weights it for a plain `model.fit` (`StreamPlan.weight_scale`)."""
        if self.count is not None and not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        index += self.skipped  # Its place in the epoch, which may have begun late.
        where = self.source_index(index)
        batch = self._read(where)
        self._padder.check(batch, f"Batch {where}")
        return self._padder.pad(batch, scale, self.plan, index)

    def first_batch(self):
        return self.batch(0) if not self.shuffle else self._padder.pad(self._read(0))

    def _read(self, where: int) -> tuple:
        """The user's batch `where` as numpy `(x, y, sample_weight)`, class-weighted."""
        batch = as_numpy_batch(self.source[where], f"batch {where}")
        return class_weighted_batch(batch, self.class_weight, f"batch {where}")

    def on_epoch_end(self) -> None:
        self.source.on_epoch_end()


class IterableBatches:
    """Batches of a Python generator (or a Grain data set, a torch DataLoader), padded as
    they come.

    Only the first batch is read before training (for its size and structure). A generator
    is read on from where the last epoch stopped, as Keras reads one (with
    `steps_per_epoch`, or once to its end); a re-iterable source (Grain) starts afresh every
    epoch. `rows` keeps one process's rows of every global batch (several processes read
    the same stream and keep their share).
    """

    def __init__(
        self,
        source: Any,
        *,
        num_replicas: int,
        remainder: str = "pad",
        training: bool = True,
        kind: str | None = None,
    ):
        generator = (kind or classify(source)) == GENERATOR
        self.kind = "generator" if generator else type(source).__name__
        self.source = source
        self._iterator = iter(source)
        self.reiterable = self._iterator is not source and not generator
        try:
            first = next(self._iterator)
        except StopIteration:
            raise ValueError(
                f"The {self.kind} is empty: it yielded no batch. Received: {source!r}"
            ) from None
        self._first = first
        self._padder = _Padder(
            as_numpy_batch(first, "batch 0"),
            num_replicas=num_replicas,
            remainder=_served(remainder, training),
            kind=self.kind,
        )
        self.has_targets = self._padder.has_targets
        self.weighted = self._padder.weighted
        length = None
        if self.reiterable:
            try:
                length = len(source)
            except TypeError:
                length = None
        # A repeated Grain MapDataset (`.repeat()`) says its length is sys.maxsize: endless.
        import sys

        infinite = length is not None and length >= sys.maxsize
        if infinite:
            length = None
        self._length = length
        self.plan = StreamPlan(
            batch_size=self._padder.first_rows,
            static_rows=self._padder.static_rows,
            num_batches=length if remainder != "drop" else None,
            infinite=infinite,
            pads=remainder not in UNPADDED,
            remainder=remainder,
            training=training,
            kind=self.kind,
        )
        self.epoch = 0
        self._started = False

    def first_batch(self):
        return self._padder.pad(as_numpy_batch(self._first, "batch 0"))

    def with_remainder(self, remainder: str) -> IterableBatches:
        """These batches under another `remainder` policy, not yet read: the same source
        and first batch. A generator cannot be read again from its start: made anew from it,
        its first batch, read here already to learn the batch size, would be lost."""
        if self._started:
            raise RuntimeError("with_remainder: these batches have been read already")
        other = copy.copy(self)
        other.set_remainder(remainder)
        return other

    def set_remainder(self, remainder: str) -> None:
        """This object's `remainder` policy (a copy's, in `with_remainder`), its padder its own."""
        self._padder = copy.copy(self._padder)
        self._padder.remainder = _served(remainder, self.plan.training)
        self.plan = dataclasses.replace(
            self.plan,
            remainder=remainder,
            num_batches=self._length if remainder != "drop" else None,
            pads=remainder not in UNPADDED,
        )

    def _elements(self):
        # The first batch was read to learn the batch size: it is served first, once.
        if not self._started:
            self._started = True
            import itertools

            return itertools.chain([self._first], self._iterator)
        if self.reiterable:
            return iter(self.source)
        return self._iterator

    def batches(self, scale: bool = False):
        """The padded batches of one pass: `(x, y, sample_weight, row_mask)` tuples."""
        index = 0
        for position, element in enumerate(self._elements()):
            batch = as_numpy_batch(element, f"batch {position}")
            if not self._padder.check(batch, f"Batch {position}"):
                continue
            yield self._padder.pad(batch, scale, self.plan, index)
            index += 1


def _served(remainder: str, training: bool) -> str:
    """The padder's policy: an evaluation sees every batch ("drop" is training's only); the
    ways to give code its real rows alone hold for both (`batching.UNPADDED`)."""
    return remainder if training or remainder in UNPADDED else "pad"


def refuse_preprocessing(batches, preprocess) -> None:
    """A keras-hub task's preprocessing runs in tf.data (as keras-hub's own `fit` runs it);
    a generator's batches never pass through a pipeline of ours."""
    if preprocess is not None:
        raise ValueError(
            f"A keras-hub task's preprocessing (raw inputs in) runs over arrays or a "
            f"tf.data.Dataset. Received: a {batches.plan.kind}. Pass the arrays, or a "
            "tf.data.Dataset of raw inputs, or preprocess in the generator and give the "
            "task's backbone model instead."
        )
