"""Arrays on disk, read a batch of rows at a time: memory maps and array-likes.

Data larger than memory is kept on disk as an `np.memmap` (a numpy array over a file's
pages) or as an array-like that reads its rows when indexed: an h5py or zarr dataset, or
any object with `shape`, `dtype`, `__getitem__` and `__len__` (Keras takes one through its
`__array__`, and converts it whole). Nothing here converts one whole: a read returns only
the rows asked for, a contiguous range of a numpy array as a view (of a memory map too:
its pages are the file's, read when the batch is, and reclaimable), any other rows as an
array of their own, batch-sized. The views that `validation_split` and `class_weight` make
of data on disk (`RowRange`, `MappedRows`) are array-likes of the same kind, read with the
batches. `on_disk` says which arrays are on disk: the backends read those from the host,
batch by batch, where an in-memory array may be held whole (TensorFlow's programs that
gather their own rows).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np

# Modules whose arrays are in memory and converted whole, as Keras converts them: tensors
# of the backends (their own branches in `inputs.to_numpy`) and pandas objects, whose
# `__getitem__` reads labels, not positions.
_CONVERTED = ("jax", "jaxlib", "tensorflow", "torch", "pandas")


def is_array_like(value: Any) -> bool:
    """Whether `value` is an array-like read by rows: not a numpy array (a memory map is
    one, read through numpy), with `shape` (one axis or more), `dtype`, `__getitem__` and
    `__len__`; not a tensor of a backend nor a pandas object."""
    if isinstance(value, (np.ndarray, str, bytes, dict, list, tuple)):
        return False
    module = (type(value).__module__ or "").split(".")[0]
    if module in _CONVERTED:
        return False
    shape = getattr(value, "shape", None)
    return (
        isinstance(shape, tuple)
        and len(shape) >= 1
        and hasattr(value, "dtype")
        and hasattr(value, "__getitem__")
        and hasattr(value, "__len__")
    )


def on_disk(array: Any) -> bool:
    """Whether `array`'s rows lie outside the process's own memory: an array-like
    (`is_array_like`), or a numpy array over a memory map (`np.memmap`, a view of one, an
    array made over an `mmap.mmap`). A numpy array that `np.take` made from a memory map
    is an `np.memmap` instance too, but one over memory of its own: not on disk."""
    if not isinstance(array, np.ndarray):
        return is_array_like(array)
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, mmap.mmap)


def copy_on_write(array: Any) -> Any:
    """`array`, a read-only memory map of a file, mapped again copy-on-write: the same rows,
    read from the same pages of the page cache, but writable, where a write stays in this
    process's own copy of that page (`np.memmap` mode "c"), never in the file. Anything else
    is returned as it is.

    Why: torch shares no read-only memory, so each batch of a read-only map had to be copied
    before it became a tensor (a step may write to its batch in place): 2.5 to 4.4 times the
    in-memory time of `evaluate` and `predict` on a one-layer model, measured
    (docs/benchmarks.md). A copy-on-write batch is shared as an in-memory one is.

    Only a C-contiguous view whose file and position are known: an `np.memmap` (or a view of
    one) over the mapping numpy made of its `filename`."""
    if (
        not isinstance(array, np.memmap)
        or array.flags.writeable
        or not array.flags.c_contiguous
        or not isinstance(getattr(array, "filename", None), (str, os.PathLike))
        or array.size == 0
    ):
        return array
    mapping = array
    while isinstance(mapping, np.ndarray):
        mapping = mapping.base
    if not isinstance(mapping, mmap.mmap):
        return array
    # numpy maps the file from `offset` rounded down to the allocation granularity; the view
    # lies `ctypes.data - start of the mapping` bytes after that.
    mapped_from = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY
    start = np.frombuffer(mapping, np.uint8, count=1).ctypes.data
    position = mapped_from + array.ctypes.data - start
    try:
        return np.memmap(
            array.filename, array.dtype, "c", offset=position, shape=array.shape, order="C"
        )
    except (OSError, ValueError):  # The file moved, shrank, or cannot be opened again.
        return array


def read_range(array: Any, start: int, stop: int) -> np.ndarray:
    """Rows `start` to `stop - 1` of `array`: a view of a numpy array, no copy (of a memory
    map too: its pages are the file's, read when the batch is), else the rows read."""
    if isinstance(array, np.ndarray):
        return array[start:stop]
    return _checked(array, np.asarray(array[start:stop]), stop - start)


def read_rows(array: Any, positions: np.ndarray) -> np.ndarray:
    """Rows at `positions` (distinct, in any order) of `array`, in that order, as an array
    of their own.

    An array-like is asked for its rows in increasing order (h5py refuses any other) with
    one index array, and they are put back in `positions`' order here; one that takes no
    index array (only integers and slices) is read row by row."""
    if isinstance(array, np.ndarray):
        # Taken from a plain view: `np.take` of an `np.memmap` gives an `np.memmap` (over
        # memory of its own), where every other batch is a plain array.
        return array.view(np.ndarray).take(positions, axis=0)
    positions = np.asarray(positions, np.int64)
    if not len(positions):
        return _checked(array, np.asarray(array[0:0]), 0)
    order = np.argsort(positions, kind="stable")
    ascending = positions[order]
    try:
        rows = np.asarray(array[ascending])
    except (TypeError, IndexError, ValueError, KeyError):
        rows = _row_by_row(array, ascending)
    rows = _checked(array, rows, len(positions))
    out = np.empty_like(rows)
    out[order] = rows
    return out


def _row_by_row(array: Any, positions: np.ndarray) -> np.ndarray:
    try:
        return np.stack([np.asarray(array[int(i)]) for i in positions])
    except (TypeError, IndexError, ValueError, KeyError) as error:
        raise TypeError(
            f"keras_accel reads an array-like input a batch of rows at a time, by index: "
            f"`array[start:stop]`, `array[np.array([i, j, ...])]` (increasing) or `array[i]`. "
            f"Received: {type(array).__name__} of shape {array.shape}, whose indexing failed "
            f"with {type(error).__name__}: {error}. Give it numpy-style row indexing, or pass "
            "an np.memmap or an in-memory numpy array."
        ) from error


def _checked(array: Any, rows: np.ndarray, count: int) -> np.ndarray:
    expected = (count, *tuple(array.shape)[1:])
    if rows.shape != expected:
        raise ValueError(
            f"An array-like input returned rows of shape {rows.shape} where {expected} were "
            f"asked for. Received: {type(array).__name__} of shape {array.shape}. Its "
            "`__getitem__` must return the rows asked for, as numpy indexing does."
        )
    return rows


class RowRange:
    """Rows `start` to `stop - 1` of an array-like, read only when indexed: what
    `validation_split` cuts from data on disk (slicing an h5py dataset reads the rows)."""

    def __init__(self, source: Any, start: int, stop: int):
        self.source, self.start, self.stop = source, int(start), int(stop)
        self.shape = (self.stop - self.start, *tuple(source.shape)[1:])
        self.dtype = source.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError(f"RowRange takes slices of step 1. Received: {key}")
            return self.source[self.start + start : self.start + max(start, stop)]
        if isinstance(key, (int, np.integer)):
            if not -len(self) <= key < len(self):
                raise IndexError(f"row {key} out of range for {len(self)} rows")
            return self.source[self.start + int(key) % len(self)]
        return self.source[np.asarray(key, np.int64) + self.start]

    def __array__(self, dtype=None, copy=None):
        # Only where something asks for the whole range at once (not keras_accel's batches).
        rows = np.asarray(self.source[self.start : self.stop])
        return rows if dtype is None else rows.astype(dtype)

    def __repr__(self) -> str:
        return f"RowRange({type(self.source).__name__}, rows {self.start}:{self.stop})"


def rows_of(array: Any, start: int, stop: int) -> Any:
    """Rows `start` to `stop - 1` of an array without reading them: a `RowRange` of an
    array-like on disk; a slice of anything else (a numpy view, of a memory map too)."""
    if array is None:
        return None
    if is_array_like(array):
        return RowRange(array, start, stop)
    return array[start:stop]


class MappedRows:
    """`fn` of another array's rows, row by row, computed only for the rows read: the
    class weights of targets on disk (`fn` maps a batch of targets to its weights)."""

    def __init__(self, source: Any, fn: Callable[[np.ndarray], np.ndarray], dtype: str):
        self.source, self.fn = source, fn
        self.shape = (len(source),)
        self.dtype = np.dtype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return self.fn(np.asarray(self.source[int(key) : int(key) + 1]))[0]
        if isinstance(key, slice):
            rows = np.asarray(self.source[key])
        else:
            rows = read_rows(self.source, np.asarray(key, np.int64))
        return np.asarray(self.fn(rows), self.dtype)
