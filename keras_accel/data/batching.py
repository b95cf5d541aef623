"""Static-shape batching: every batch the compiled step sees has the same number of rows.

A data set of N rows cut into global batches of B rows leaves a last, partial batch. Under
data parallelism that batch crashes raw Keras (it does not split across replicas) and, even
where it runs, its new shape costs a second compilation. Here every batch is padded to one
static size. Which rows are real travels with the batch as a row mask (1 real, 0 padding), so
padding never counts in a loss, a metric or (see `keras_accel.adapter.batchnorm`) a
BatchNormalization statistic, while a real row that the user weighted 0 counts where plain
Keras counts it.

The one table of padding arithmetic is `BatchPlan`: rows per batch, and the factor by which
real rows are weighted. For Keras's default loss reduction `sum_over_batch_size`
(loss = sum(w * l) / rows):

- training: the real rows of a padded batch get weight `static_rows / real_rows`, so the
  loss, and therefore the update, equals the mean over the real rows alone;
- evaluation: every real row of every batch gets the same weight
  `num_batches * static_rows / num_samples`. Keras averages batch losses weighted by the
  static batch size, so this uniform factor makes the reported loss the exact mean over the
  real samples, and weighted metrics are unchanged by a uniform factor.

Those weights are applied where the batch is consumed, not where it is made: the
Accelerator's step wrappers (`keras_accel.adapter.steps`) scale a padded batch's weights by
`static_rows / real_rows` of that batch, and weight its loss in the epoch average by its real
rows. That needs nothing but the batch itself, so an input of unknown length (a streamed
`tf.data` pipeline, a generator) is exact without being counted first. The table form
(`BatchPlan.weight_scales`, which knows the whole data set) is what a plain `model.fit`
gets from `Accelerator.dataset(...)`, where no wrapper of ours sees the step.

A data set read as it comes has a `StreamPlan` instead: its batch size and static size from
its first batch, its length in batches where it knows one. Everything in this module is
numpy and backend-free.

What the Accelerator's own step wrappers receive is `(x, y, (sample_weight, row_mask))`, or
`(x, row_mask)` where there are no targets; `keras_accel.adapter.steps` turns it into what
the model's step expects: `(x, y)`, `(x, y, sample_weight)` or `(x,)`, as plain Keras would
give it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

REMAINDER_POLICIES = ("pad", "drop")
# What a plan does with a short last batch: a user's policy, or one of two ways to give the
# model's step its real rows alone, unpadded, chosen by the Accelerator where the model's
# code cannot weight padding rows out (`keras_accel.adapter.batches`), by what the runtime
# runs (`Runtime.whole_remainder`): "whole", a batch of its real rows (one replica); "cut",
# padded as any other, and marked with its real row count, so that the step cuts the padding
# off before the model's code sees it (JAX, whose program holds the global batch);
# "replicate", its real rows whole in every replica, marked, each replica running the step on
# all of them as one device would, without the collectives that would count them once per
# replica (torch's processes, whose programs each hold a share of the others' batches).
PLAN_REMAINDERS = (*REMAINDER_POLICIES, "whole", "cut", "replicate")
UNPADDED = ("whole", "cut", "replicate")
# Remainders whose short last batch is a batch of its real rows (`BatchPlan.batch_rows`).
REAL_ROWS = ("whole", "replicate")


def static_batch_size(batch_size: int, num_replicas: int) -> int:
    """The padded batch size: `batch_size` rounded up to a multiple of `num_replicas`.

    A batch smaller than the replica count is padded up to one row per replica (plain Keras
    trains it on one device): the replicas without a real row compute on padding, weighted
    out like any other (`keras_accel.adapter.feeder` says so, once).
    """
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool):
        raise TypeError(f"`batch_size` must be an integer. Received: batch_size={batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be positive. Received: batch_size={batch_size}")
    return int(math.ceil(batch_size / num_replicas) * num_replicas)


def bucket_rows(rows: int, static_rows: int) -> int:
    """The static size of a batch of `rows` rows in a stream whose first batch set
    `static_rows` (a replica multiple): `static_rows` itself for a batch that fits, else
    `static_rows` doubled until it fits. Plain Keras takes batches of any size from a
    generator, a PyDataset or tf.data; here a larger batch is padded to the next of these
    buckets, so that a stream of batch sizes up to B compiles at most
    1 + log2(B / static_rows) step programs (a new size is a new program), each a replica
    multiple, and every row a batch had is in it."""
    if rows <= static_rows:
        return static_rows
    return static_rows * 2 ** math.ceil(math.log2(rows / static_rows))


def share_rows(rows: slice | None, static_rows: int, batch_rows: int) -> slice | None:
    """One process's `rows` of a global batch of `static_rows` rows, for a batch of
    `batch_rows` rows (a bucket, `bucket_rows`): the same fraction of it (each process's
    devices hold the same fraction of any batch, in order)."""
    if rows is None or batch_rows == static_rows:
        return rows
    return slice(rows.start * batch_rows // static_rows, rows.stop * batch_rows // static_rows)


def flatten(structure: Any) -> list:
    """The leaves of a nested dict/list/tuple, dict keys in sorted order (None kept)."""
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure) for leaf in flatten(structure[key])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [structure]


def num_rows(structure: Any) -> int:
    leaves = [leaf for leaf in flatten(structure) if leaf is not None]
    return int(leaves[0].shape[0]) if leaves else 0


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
    """`array` with copies of its last row appended along axis 0 up to `rows` (zeros, ""
    for text, where it has no row): the inputs and targets of a padding row.

    Copies of a real row, not zeros, because user code sees padding rows before any weight
    can take them out: a `StringLookup(num_oov_indices=0)` refuses "", a `log` or a division
    turns a row of zeros into inf, and 0 times inf is a NaN in the weighted sum. A real
    row's values are ones the user's code already handles; weighted 0, they add exact zeros.
    A padding row's weight and mask are 0 (`pad_zeros`)."""
    missing = _missing(array, rows)
    if missing == 0:
        return array
    if array.shape[0] == 0:
        return pad_zeros(array, rows)
    return np.concatenate([array, np.repeat(array[-1:], missing, axis=0)], axis=0)


def pad_zeros(array: np.ndarray, rows: int) -> np.ndarray:
    """`array` with zero rows ("" for text) appended along axis 0 up to `rows`: a padding
    row's sample weight and row mask."""
    missing = _missing(array, rows)
    if missing == 0:
        return array
    fill = "" if array.dtype.kind in "OUS" else 0
    padding = np.full((missing,) + array.shape[1:], fill, dtype=array.dtype)
    return np.concatenate([array, padding], axis=0)


def _missing(array: np.ndarray, rows: int) -> int:
    missing = rows - array.shape[0]
    if missing < 0:
        raise ValueError(
            f"A batch of {array.shape[0]} rows does not fit the static batch size of {rows} "
            "rows: pad it to `bucket_rows(rows, static_rows)` rows instead."
        )
    return missing


def pack(x: Any, y: Any, sample_weight: Any, row_mask: Any, cut: int | None = None) -> tuple:
    """The batch the Accelerator's step wrappers receive (see the module docstring).

    `cut` (a plan's `cut_rows`): the real rows the step cuts the batch to, 0 for none,
    carried as the shape of an empty marker array `(0, cut)` beside the row mask: a shape is
    what a compiled step knows when it is traced, and 0 rows split over any number of
    devices. Every batch of a call carries one, so that all have one structure."""
    if cut is None:
        if y is None:
            return (x,) if row_mask is None else (x, row_mask)
        return x, y, (sample_weight, row_mask)
    # An int, or a marker made already (`tf_padding`'s, in the graph, of a row count known
    # only there).
    marker = np.zeros((0, cut), "float32") if isinstance(cut, (int, np.integer)) else cut
    if y is None:
        return x, (row_mask, marker)
    return x, y, (sample_weight, row_mask, marker)


def unpack(data: Any) -> tuple[Any, Any, Any, Any]:
    """`(x, y, sample_weight, row_mask)` from what `pack` made (None where absent)."""
    if len(data) == 1:
        return data[0], None, None, None
    if len(data) == 2:
        mask = data[1][0] if isinstance(data[1], tuple) else data[1]
        return data[0], None, None, mask
    x, y, (sample_weight, row_mask, *_) = data
    return x, y, sample_weight, row_mask


def cut_rows(data: Any) -> int | None:
    """The real rows a batch from `pack` is to be cut to in the step, or None (not marked, or
    a full batch)."""
    if len(data) == 2 and isinstance(data[1], tuple):
        marker = data[1][1]
    elif len(data) == 3 and len(data[2]) == 3:
        marker = data[2][2]
    else:
        return None
    rows = int(marker.shape[1])
    return rows or None


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How an epoch of `num_samples` rows is cut into batches of `static_rows` rows.

    Attributes:
        num_samples: rows in the data set.
        batch_size: rows of real data per batch, as the user asked (every batch but the last
            has exactly this many).
        static_rows: rows per batch as the compiled step sees them (a replica multiple).
        remainder: "pad" keeps the last partial batch (padded); "drop" skips it; "whole"
            keeps it unpadded, as a batch of its real rows (`batch_rows`); "cut" pads it,
            marked to be cut to its real rows in the step (`cut_rows`); "replicate" keeps it
            as a batch of its real rows, marked, which every replica reads whole
            (`replicated`).
        training: selects the weight rule (see the module docstring).
    """

    num_samples: int
    batch_size: int
    static_rows: int
    remainder: str = "pad"
    training: bool = True

    def __post_init__(self):
        if self.remainder not in PLAN_REMAINDERS:
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

    def batch_rows(self, index: int) -> int:
        """Rows of batch `index` as its step sees them: `static_rows`, but for a short last
        batch that runs whole (`remainder="whole"` or `"replicate"`): its real rows."""
        if self.remainder in REAL_ROWS:
            real = self.rows_in_batch(index)
            if real < self.batch_size:
                return real
        return self.static_rows

    def cut_rows(self, index: int) -> int | None:
        """Under `remainder="cut"` (or `"replicate"`), the real rows batch `index`'s step
        cuts it to (its marker, `pack`): a short last batch's rows, 0 for a full batch
        (nothing to cut); None under any other remainder (no marker)."""
        if self.remainder not in ("cut", "replicate"):
            return None
        real = self.rows_in_batch(index)
        return real if real < self.batch_size else 0

    def replicated(self, index: int) -> bool:
        """Whether every replica reads batch `index` whole: a short last batch under
        `remainder="replicate"`."""
        return self.remainder == "replicate" and self.rows_in_batch(index) < self.batch_size

    @property
    def remainder_rows(self) -> int | None:
        """The rows of a last batch that runs unpadded; None where there is none."""
        if self.remainder not in UNPADDED or self.num_samples % self.batch_size == 0:
            return None
        return self.num_samples % self.batch_size

    @functools.cached_property
    def real_rows(self) -> np.ndarray:
        """Real rows of every batch, as int64: the table the input pipelines index."""
        return np.array([self.rows_in_batch(i) for i in range(self.num_batches)], "int64")

    @functools.cached_property
    def weight_scales(self) -> np.ndarray:
        """The factor on every real row's weight, per batch, as float32."""
        if self.training:
            scales = (self.static_rows / self.real_rows).astype("float32")
            if self.remainder_rows is not None:
                scales[-1] = 1.0  # Its own rows alone: nothing to scale.
            return scales
        uniform = self.num_batches * self.static_rows / self.real_rows.sum()
        return np.full(self.num_batches, uniform, "float32")

    @property
    def pads(self) -> bool:
        """Whether any batch carries padding rows."""
        if self.remainder in UNPADDED:  # Its full batches only, which all have as many rows.
            return self.static_rows != self.batch_size and self.num_samples >= self.batch_size
        return bool((self.real_rows != self.static_rows).any())

    def describe(self) -> str:
        """The batching in words, for messages: "230 rows in batches of 64"."""
        return f"{self.num_samples} rows in batches of {self.batch_size}"

    @property
    def rows_seen(self) -> int:
        """Real rows an epoch visits (fewer than `num_samples` when the remainder is dropped)."""
        return int(self.real_rows.sum())

    def permutation(self, seed: int | None, epoch: int, shuffle: bool) -> np.ndarray:
        """Row order for one epoch: a fresh shuffle per epoch, reproducible from the seed."""
        if not shuffle:
            return np.arange(self.num_samples)
        rng = np.random.default_rng(None if seed is None else [seed, epoch])
        return rng.permutation(self.num_samples)


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How a data set read as it comes is batched: what its first batch says, and its length
    in batches where the data set knows one. Its row count is never known in advance, and
    never needed: a batch's real rows travel with it (the row mask).

    Attributes:
        batch_size: rows of the first batch, the size every full batch has.
        static_rows: rows per batch as the compiled step sees them (a replica multiple).
        num_batches: batches per pass, where the data set knows it; None where it does not
            (it ends when it ends) or is infinite.
        infinite: the data set repeats for ever (only `steps_per_epoch` ends an epoch).
        pads: whether a batch may carry padding rows that reach the step. True unless
            every batch is known to be full and a replica multiple (a tf.data batch
            dimension fixed by `drop_remainder=True`), or the remainder gives the step real
            rows alone (`UNPADDED`): a short batch is recognised when it arrives.
        remainder: "pad" keeps a partial batch (padded); "drop" skips it when it arrives;
            "whole", "cut" or "replicate" (`PLAN_REMAINDERS`) give the model's code the real
            rows of every batch that has padding, as a batch's rows are known: when it
            arrives (`cut_of`).
        training: the weight rule of `Accelerator.dataset` for a plain `model.fit`.
        kind: what the data set is, for messages ("tf.data.Dataset", "generator").
    """

    batch_size: int
    static_rows: int
    num_batches: int | None = None
    infinite: bool = False
    pads: bool = True
    remainder: str = "pad"
    training: bool = True
    kind: str = "data set"

    num_samples = None  # Never known in advance.

    def __post_init__(self):
        if self.remainder not in PLAN_REMAINDERS:
            raise ValueError(
                f"`remainder` must be one of {REMAINDER_POLICIES}. "
                f"Received: remainder={self.remainder!r}"
            )

    def describe(self) -> str:
        length = (
            "repeating for ever"
            if self.infinite
            else f"{self.num_batches} batches"
            if self.num_batches is not None
            else "of unknown length"
        )
        return f"a {self.kind} ({length}) in batches of {self.batch_size}"

    def cut_of(self, batch: tuple) -> int | None:
        """The real rows the step cuts padded `batch` (`(x, y, sample_weight, row_mask)`) to
        under "cut" and "replicate" (0: it has no padding), as `BatchPlan.cut_rows` says by
        index where the rows are known in advance; None under the other remainders."""
        if self.remainder not in ("cut", "replicate"):
            return None
        mask = np.asarray(batch[3])
        real = int(np.count_nonzero(mask))
        return real if real < mask.shape[0] else 0

    def weight_scale(self, index: int, real_rows: int, static_rows: int | None = None) -> float:
        """The factor on a batch's real rows' weights for a plain `model.fit`: the mean over
        its real rows (training's rule; for evaluation too, since the total is unknown).
        `static_rows`: the batch's own static size where it outgrew the first
        (`bucket_rows`)."""
        return (static_rows or self.static_rows) / real_rows


def pad_batch(
    x: Any, y: Any, sample_weight: Any, rows: int, weight_scale: float = 1.0
) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    """Pad one batch to `rows` rows: `(x, y, sample_weight, row_mask)`.

    Real rows keep their weight (1 if none was given) times `weight_scale`; padding rows
    (copies of the last real row, `pad_rows`) get weight 0 and mask 0. A weight array keeps
    its shape beyond the first axis (Keras accepts `(N,)` and `(N, 1)`, or per-timestep
    weights).
    """
    real = num_rows(x)
    weights = np.ones((real,), "float32") if sample_weight is None else sample_weight
    weights = np.asarray(weights, dtype="float32") * np.float32(weight_scale)
    pad = lambda a: pad_rows(np.asarray(a), rows)  # noqa: E731
    mask = pad_zeros(np.ones((real,), "float32"), rows)
    return map_structure(pad, x), map_structure(pad, y), pad_zeros(weights, rows), mask


def padding_like(batch: tuple) -> tuple:
    """A batch of padding only, shaped as `batch` (`(x, y, sample_weight, row_mask)`,
    numpy): `batch`'s inputs and targets (real values, see `pad_rows`), its weights and row
    mask 0. What a process whose own data has ended feeds while another's has not, so that
    every process runs every step."""
    x, y, weights, mask = batch
    zeros = lambda a: np.zeros_like(a)  # noqa: E731
    return x, y, map_structure(zeros, weights), map_structure(zeros, mask)


def same_rows(batches: Sequence) -> list:
    """Batches (as `pack` makes them) brought to the largest one's rows: batches of one
    stream may sit in different buckets (`bucket_rows`), and a group of them run in one
    compiled program (steps_per_execution) is stacked on a new axis. The rows added are
    padding as `pad_batch` adds it (copies of a real row, weight and row mask 0), so every
    step's results are those of its real rows, as before. Numpy batches, or batches on the
    devices already (JAX)."""
    counts = [num_rows(batch[0]) for batch in batches]
    rows = max(counts)
    if all(count == rows for count in counts):
        return list(batches)
    out = []
    for batch, count in zip(batches, counts):
        if count < rows:
            marked = (len(batch) == 2 and isinstance(batch[1], tuple)) or (
                len(batch) == 3 and len(batch[2]) == 3
            )
            cut = (cut_rows(batch) or 0) if marked else None
            x, y, weights, mask = unpack(batch)
            x, y = (map_structure(lambda a: _grown(a, rows, True), t) for t in (x, y))
            weights, mask = (None if t is None else _grown(t, rows, False) for t in (weights, mask))
            batch = pack(x, y, weights, mask, cut)
        out.append(batch)
    return out


def _grown(leaf, rows: int, repeat: bool):
    """`pad_rows` (`repeat`) or `pad_zeros` of a leaf on the host or on the devices."""
    if isinstance(leaf, np.ndarray):
        return pad_rows(leaf, rows) if repeat else pad_zeros(leaf, rows)
    import jax.numpy as jnp

    missing = rows - int(leaf.shape[0])
    if repeat and leaf.shape[0]:
        return jnp.concatenate([leaf, jnp.repeat(leaf[-1:], missing, axis=0)], axis=0)
    return jnp.pad(leaf, [(0, missing)] + [(0, 0)] * (len(leaf.shape) - 1))


def check_same_length(arrays: Sequence[tuple[str, Any]]) -> int:
    """The common row count of named structures; a clear error when they disagree."""
    lengths = {}
    for name, structure in arrays:
        if structure is None:
            continue
        for leaf in flatten(structure):
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


def element(batch, carry_mask: bool, rows, static_rows: int | None = None, cut=None):
    """One padded batch as Keras's step reads it: `pack(x, y, weights, mask, cut)` with the
    row mask, or `(x,)` / `(x, y, weights)` without; `rows` picks a slice of its rows (of a
    batch of `static_rows`; the same fraction of a larger bucket, `share_rows`)."""
    x, y, sample_weight, row_mask = batch
    if rows is not None:
        if static_rows is not None:
            rows = share_rows(rows, static_rows, num_rows(row_mask))
        x, y, sample_weight, row_mask = map_structure(
            lambda a: a[rows], (x, y, sample_weight, row_mask)
        )
    if not carry_mask:
        return (x,) if y is None else (x, y, sample_weight)
    return pack(x, y, sample_weight, row_mask, cut)
