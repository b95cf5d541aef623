"""Grain's data sets: how a `MapDataset.batch(...)` (and its `.to_iter_dataset()`) batches
its parent, which `BatchMapDataset` and `PrefetchIterDataset` keep private."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from keras_accel.utils.library_internals.lookup import Internal

INTERNALS = [
    Internal(
        "Grain",
        "grain BatchMapDataset / PrefetchIterDataset instances",
        "_batch_size, _drop_remainder, _batch_fn, _read_options",
        "how a Grain data set batches its parent, so that each process reads only its rows",
        fallback="every process reads the whole data set and keeps its own rows",
    ),
]


@dataclasses.dataclass(frozen=True)
class GrainBatching:
    """How a Grain `MapDataset.batch(...)` batches its parent (`grain_batching`)."""

    parent: Any  # The MapDataset whose elements are batched.
    batch_size: int
    drop_remainder: bool
    batch_fn: Callable | None
    read_options: Any  # `to_iter_dataset(read_options)`'s; None for a MapDataset.


def grain_batching(dataset) -> GrainBatching | None:
    """The batching of a Grain data set that is `parent.batch(n)` (a `MapDataset`), or that
    made into an `IterDataset` by `.to_iter_dataset()`; None for any other Grain data set.

    Grain's `BatchMapDataset` and `PrefetchIterDataset` keep their arguments private
    (`_batch_size`, `_drop_remainder`, `_batch_fn`, `_read_options`); their parents are
    public (`parents`). Checked against Grain 0.2.18. A Grain without them gives None (and
    every process reads the whole data set, as for any other stream), never an error.
    """
    read_options = None
    name = type(dataset).__name__
    if name == "PrefetchIterDataset":
        read_options = getattr(dataset, "_read_options", None)
        parents = getattr(dataset, "parents", ())
        if read_options is None or len(parents) != 1:
            return None
        dataset, name = parents[0], type(parents[0]).__name__
    if name != "BatchMapDataset" or not type(dataset).__module__.startswith("grain."):
        return None
    try:
        (parent,) = dataset.parents
        return GrainBatching(
            parent=parent,
            batch_size=int(dataset._batch_size),
            drop_remainder=bool(dataset._drop_remainder),
            batch_fn=dataset._batch_fn,
            read_options=read_options,
        )
    except (AttributeError, TypeError, ValueError):
        return None
