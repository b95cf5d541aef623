"""Static-shape batching: every batch the compiled step sees has the same number of rows.

A data set of N rows cut into global batches of B rows leaves a last, partial batch. Under
data parallelism that batch crashes raw Keras (it does not split across replicas) and, even
where it runs, its new shape costs a second compilation. Here every batch is padded to one
static size; padding rows carry sample weight 0, so they never count in a loss, a metric or
(see `keras_accel.adapter.batchnorm`) a BatchNormalization statistic.

The math of the weights, for the Keras default loss reduction `sum_over_batch_size`
(loss = sum(w * l) / rows):

- training: the real rows of a padded batch get weight `static_rows / real_rows`, so the
  loss, and therefore the update, equals the mean over the real rows alone;
- evaluation: every real row of every batch gets the same weight
  `num_batches * static_rows / num_samples`. Keras averages batch losses weighted by the
  static batch size, so this uniform factor makes the reported loss the exact mean over the
  real samples, and weighted metrics are unchanged by a uniform factor.

Everything here is numpy and backend-free; the backend modules only wrap it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

REMAINDER_POLICIES = ("pad", "drop")


def static_batch_size(batch_size: int, num_replicas: int) -> int:
    """The padded batch size: `batch_size` rounded up to a multiple of `num_replicas`.

    Raises:
        ValueError: when `batch_size` is smaller than the replica count, since most replicas
            would then compute on padding alone.
    """
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool):
        raise TypeError(f"`batch_size` must be an integer. Received: batch_size={batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be positive. Received: batch_size={batch_size}")
    if batch_size < num_replicas:
        raise ValueError(
            f"`batch_size` must be at least the number of replicas, so that every replica "
            f"gets a real row. Received: batch_size={batch_size} with num_replicas="
            f"{num_replicas}. Use batch_size={num_replicas} or a larger multiple of it."
        )
    return int(math.ceil(batch_size / num_replicas) * num_replicas)


def _num_rows(structure: Any) -> int:
    leaves = [leaf for leaf in _flatten(structure) if leaf is not None]
    return int(leaves[0].shape[0]) if leaves else 0


def _flatten(structure: Any) -> list:
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure) for leaf in _flatten(structure[key])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in _flatten(item)]
    return [structure]


def map_structure(fn, structure: Any) -> Any:
    """Apply `fn` to every array of a nested dict/list/tuple, keeping None."""
    if structure is None:
        return None
    if isinstance(structure, dict):
        return {key: map_structure(fn, value) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_structure(fn, item) for item in structure)
    return fn(structure)


def pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows appended along axis 0 up to `rows` rows."""
    missing = rows - array.shape[0]
    if missing == 0:
        return array
    if missing < 0:
        raise ValueError(
            f"A batch of {array.shape[0]} rows does not fit the static batch size of {rows} "
            "rows. Every batch of a data set must be at most as large as its first batch."
        )
    padding = np.zeros((missing,) + array.shape[1:], dtype=array.dtype)
    return np.concatenate([array, padding], axis=0)


def pad_batch(
    x: Any,
    y: Any,
    sample_weight: np.ndarray | None,
    rows: int,
    weight_scale: float,
) -> tuple[Any, Any, np.ndarray]:
    """Pad one batch to `rows` rows and return `(x, y, sample_weight)`.

    Real rows keep their weight (1 if none was given) times `weight_scale`; padding rows get 0.
    """
    real = _num_rows(x)
    weights = np.ones((real,), "float32") if sample_weight is None else sample_weight
    weights = np.asarray(weights, dtype="float32") * np.float32(weight_scale)
    pad = lambda a: pad_rows(np.asarray(a), rows)  # noqa: E731
    return map_structure(pad, x), map_structure(pad, y), pad_rows(weights, rows)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How an epoch of `num_samples` rows is cut into batches of `static_rows` rows.

    Attributes:
        num_samples: rows in the data set.
        batch_size: rows of real data per batch, as the user asked.
        static_rows: rows per batch as the compiled step sees them (a replica multiple).
        remainder: "pad" keeps the last partial batch (padded); "drop" skips it.
        training: selects the weight rule (see the module docstring).
    """

    num_samples: int
    batch_size: int
    static_rows: int
    remainder: str = "pad"
    training: bool = True

    def __post_init__(self):
        if self.remainder not in REMAINDER_POLICIES:
            raise ValueError(
                f"`remainder` must be one of {REMAINDER_POLICIES}. "
                f"Received: remainder={self.remainder!r}"
            )
        if self.num_samples < 1:
            raise ValueError(
                f"The data set is empty: there is nothing to iterate. "
                f"Received: num_samples={self.num_samples}"
            )
        if self.remainder == "drop" and self.num_samples < self.batch_size:
            raise ValueError(
                f"remainder='drop' with fewer samples than one batch leaves no batch at all. "
                f"Received: num_samples={self.num_samples}, batch_size={self.batch_size}. "
                "Use remainder='pad' or a smaller batch_size."
            )

    @property
    def num_batches(self) -> int:
        if self.remainder == "drop":
            return self.num_samples // self.batch_size
        return math.ceil(self.num_samples / self.batch_size)

    def rows_in_batch(self, index: int) -> int:
        start = index * self.batch_size
        return min(self.batch_size, self.num_samples - start)

    def weight_scale(self, real_rows: int) -> float:
        if self.training:
            return self.static_rows / real_rows
        return self.num_batches * self.static_rows / self.num_samples

    def permutation(self, seed: int | None, epoch: int, shuffle: bool) -> np.ndarray:
        """Row order for one epoch: a fresh shuffle per epoch, reproducible from the seed."""
        if not shuffle:
            return np.arange(self.num_samples)
        rng = np.random.default_rng(None if seed is None else [seed, epoch])
        return rng.permutation(self.num_samples)


def check_same_length(arrays: Sequence[tuple[str, Any]]) -> int:
    """The common row count of named structures; a clear error when they disagree."""
    lengths = {}
    for name, structure in arrays:
        if structure is None:
            continue
        for leaf in _flatten(structure):
            if leaf is None:
                continue
            if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
                raise ValueError(
                    f"`{name}` must hold arrays with a leading batch axis. "
                    f"Received: {type(leaf).__name__} {getattr(leaf, 'shape', '')}"
                )
            lengths.setdefault(name, set()).add(int(leaf.shape[0]))
    flat = {n for sizes in lengths.values() for n in sizes}
    if len(flat) > 1:
        detail = ", ".join(f"{name}: {sorted(sizes)}" for name, sizes in lengths.items())
        raise ValueError(
            "All arrays must have the same number of rows (first axis). "
            f"Received row counts {detail}. Pass x, y and sample_weight of equal length."
        )
    return flat.pop() if flat else 0
