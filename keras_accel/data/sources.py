"""The inputs an Accelerator accepts, each turned into a sequence of static-size padded batches.

- numpy arrays (and tuples, lists or dicts of them; strings included), memory maps and
  array-likes on disk (`keras_accel.data.on_disk`): batched, shuffled and padded here, one
  batch at a time, so the data set is never copied whole;
- `keras.utils.PyDataset` (with or without a length), Python generators and Grain data
  sets: read as they come, each batch padded to the size of the first batch (rounded up to
  a multiple of the replica count; a larger batch to a bucket, `batching.bucket_rows`),
  never counted first;
- `tf.data.Dataset` (where TensorFlow is installed): see `keras_accel.data.tfdata`.

A "batches" object here is backend-free: it has a `plan` (`keras_accel.data.batching.
BatchPlan` where the rows are known, else `StreamPlan`), `has_targets` and `weighted`, and
serves `(x, y, sample_weight, row_mask)` numpy tuples, unscaled (the step wrappers weight
them): by index (`batch(index)`: arrays, PyDataset) or as one pass (`batches()`:
generators, Grain). An `epoch` counter (which `Accelerator.fit` sets at each epoch's start)
makes shuffling a function of the epoch, so a resumed run sees the same order. The backend
modules wrap them in what `model.fit` takes.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np

from keras_accel.data import on_disk
from keras_accel.data.batching import (
    BatchPlan,
    StreamPlan,
    bucket_rows,
    check_same_length,
    flatten,
    map_structure,
    num_rows,
    pad_batch,
    static_batch_size,
)

SUPPORTED_INPUTS = (
    "numpy arrays (or tuples, lists, dicts of them; numbers or strings; sparse ones, "
    "densified; np.memmap and array-likes on disk, such as h5py datasets, read by rows), "
    "keras.utils.PyDataset, tf.data.Dataset, a Python generator, a Grain data set (JAX), "
    "a torch DataLoader"
)


# What a user's `x` is, as `classify` names it: which batches the feeder makes of it.
ARRAYS = "arrays"
TF_DATASET = "tf.data.Dataset"
PY_DATASET = "PyDataset"
GENERATOR = "generator"
GRAIN = "Grain data set"
TORCH_DATALOADER = "torch DataLoader"
STREAMS = (GENERATOR, GRAIN, TORCH_DATALOADER)  # Read as they come: `IterableBatches`.


def classify(value: Any) -> str:
    """What kind of input `value` is (`ARRAYS`, `TF_DATASET`, `PY_DATASET`, `GENERATOR`,
    `GRAIN`, `TORCH_DATALOADER`), decided once per call and passed along, so that the
    facade and the feeder never inspect `x` again. Anything that is none of the data set
    kinds is arrays (None too: the feeder says `x` is required)."""
    if is_tf_dataset(value):
        return TF_DATASET
    if is_py_dataset(value):
        return PY_DATASET
    if is_generator(value):
        return GENERATOR
    if is_grain_dataset(value):
        return GRAIN
    if is_torch_dataloader(value):
        return TORCH_DATALOADER
    return ARRAYS


def is_tf_dataset(value: Any) -> bool:
    # Checked by module name so that a JAX-only install never imports TensorFlow here.
    module = type(value).__module__ or ""
    return module.startswith("tensorflow") and hasattr(value, "element_spec")


def is_py_dataset(value: Any) -> bool:
    import keras

    return isinstance(value, keras.utils.PyDataset)


def is_array_input(value: Any) -> bool:
    return classify(value) == ARRAYS


def to_numpy(structure: Any, name: str) -> Any:
    """Every leaf as a numpy array (tensors of any backend, nested lists of numbers or
    strings), but an array-like on disk (an h5py dataset, `on_disk.is_array_like`), which
    stays as it is and is read a batch of rows at a time (`np.asarray` would read it all).
    A list of arrays is a list of inputs; a list of plain values is one array, as Keras
    reads them."""
    if structure is None:
        return None
    if isinstance(structure, dict):
        return {key: to_numpy(value, name) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        if structure and not any(_is_leaf_array(item) for item in structure):
            return np.asarray(structure)
        # A list of inputs or targets becomes a tuple, as Keras's data adapters make it
        # (`tree.lists_to_tuples`): tf.data would read a list as one stacked tensor.
        return tuple(to_numpy(item, name) for item in structure)
    if isinstance(structure, np.ndarray):
        return structure
    kind = sparse_kind(structure)
    if kind == "tf.RaggedTensor":
        raise TypeError(
            f"`{name}` is a tf.RaggedTensor, which keras_accel does not take: every batch is "
            "padded to one static shape, and padding a ragged row would change what the "
            "model computes. Pad the rows yourself with a mask "
            "(`ragged.to_tensor()` and a `keras.layers.Masking` or an explicit mask input), "
            f"or train on plain Keras. Supported inputs: {SUPPORTED_INPUTS}."
        )
    if kind is not None:
        # Densified here, as every batch is padded to a static shape: the values, and so
        # the results, are those of the sparse input (docs/accelerator.md, "Inputs").
        return _dense(structure, kind)
    if type(structure).__module__.startswith("torch") and hasattr(structure, "detach"):
        return structure.detach().cpu().numpy()  # A torch tensor (a DataLoader's batch).
    if hasattr(structure, "numpy") and callable(structure.numpy):  # tf.Tensor, strings too
        return np.asarray(structure.numpy())
    if on_disk.is_array_like(structure):
        return structure
    if hasattr(structure, "__array__") or isinstance(structure, (float, int, str, bytes)):
        return np.asarray(structure)
    raise TypeError(
        f"`{name}` must be numpy arrays or array-likes (or a tuple/list/dict of them). "
        f"Received: {type(structure).__name__}. Supported inputs: {SUPPORTED_INPUTS}."
    )


def sparse_kind(value: Any) -> str | None:
    """What sparse or ragged tensor `value` is ("scipy.sparse", "tf.SparseTensor",
    "jax BCOO", "tf.RaggedTensor"), found by module name so that nothing is imported here;
    None for anything else."""
    cls = type(value)
    module, name = cls.__module__ or "", cls.__name__
    if module.startswith("scipy.sparse") and hasattr(value, "toarray"):
        return "scipy.sparse"
    if module.startswith("tensorflow") and name in ("SparseTensor", "SparseTensorValue"):
        return "tf.SparseTensor"
    if module.startswith("tensorflow") and name == "RaggedTensor":
        return "tf.RaggedTensor"
    if module.startswith("jax.experimental.sparse") and hasattr(value, "todense"):
        return "jax BCOO"
    return None


def _dense(value: Any, kind: str) -> np.ndarray:
    # Copies, of a SparseTensor's parts too: a numpy view of a TensorFlow or JAX buffer
    # made here outlives the tensor (a generator's batches are read in tf.data's thread
    # on TensorFlow: measured, a view there read freed memory).
    if kind == "scipy.sparse":
        return np.array(value.toarray())
    if kind == "tf.SparseTensor":
        # Numpy only: no TensorFlow op runs in the thread that reads a generator.
        indices = np.array(value.indices)
        values = np.array(value.values)
        dense = np.zeros(tuple(np.array(value.dense_shape)), values.dtype)
        dense[tuple(indices.T)] = values
        return dense
    return np.array(value.todense())


def _is_leaf_array(item: Any) -> bool:
    return isinstance(item, dict) or hasattr(item, "shape") or hasattr(item, "numpy")


def standardize_sample_weight(sample_weight: Any) -> Any:
    """A float32 weight array of one weight per row (`(N,)`, `(N, 1)` or per timestep).
    Weights on disk (`on_disk.on_disk`) stay there, in their own dtype: they are read, and
    made float32, with each batch."""
    if sample_weight is None:
        return None
    if on_disk.on_disk(sample_weight):
        weights = sample_weight
    else:
        weights = np.asarray(sample_weight, dtype="float32")
    if len(weights.shape) == 0:
        raise ValueError(
            "`sample_weight` must hold one weight per row: an array of shape (N,) or (N, 1) "
            f"(or (N, timesteps) for per-timestep losses). Received: a scalar {weights!r}."
        )
    return weights


def class_weights_to_sample_weights(y: np.ndarray, class_weight: dict) -> np.ndarray:
    """Per-row weights from a `{class_index: weight}` dict, as Keras computes them: the class
    is the argmax of one-hot targets, else the (rounded) target; a class the dict does not
    name weighs 1.0 (so `{1: 5.0}` weights class 1 up and leaves the others)."""
    if y is None or isinstance(y, (dict, list, tuple)):
        raise ValueError(
            "`class_weight` is only supported for Models with a single output: it needs a "
            f"single array of targets. Received: y of type {type(y).__name__}."
        )
    check_class_weight(class_weight)
    y = np.asarray(y)
    if y.ndim > 1 and y.shape[-1] > 1:
        labels = np.argmax(y, axis=-1)
    else:
        labels = np.round(y.reshape(len(y))).astype("int64")
    table = class_weight_table(class_weight)
    inside = (labels >= 0) & (labels < len(table))
    return np.where(inside, table[np.clip(labels, 0, len(table) - 1)], 1.0).astype("float32")


def check_class_weight(class_weight) -> None:
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(
            "`class_weight` must be a non-empty dict mapping class indices to weights. "
            f"Received: class_weight={class_weight!r}"
        )
    keys = [key for key in class_weight if not isinstance(key, (int, np.integer)) or key < 0]
    if keys:
        raise ValueError(
            "`class_weight` keys must be class indices (integers >= 0). "
            f"Received: class_weight={class_weight!r}"
        )


def class_weight_table(class_weight: dict) -> np.ndarray:
    """Weights by class index up to the largest key; a class not named weighs 1.0."""
    table = np.ones(max(int(key) for key in class_weight) + 1, "float32")
    for key, weight in class_weight.items():
        table[int(key)] = weight
    return table


def _class_weighted(batch: tuple, class_weight: dict | None, where: str) -> tuple:
    """A user's `(x, y, sample_weight)` batch with `class_weight` as its sample weights."""
    if class_weight is None:
        return batch
    x, y, sample_weight = batch
    if sample_weight is not None:
        raise ValueError(
            "You cannot `class_weight` and `sample_weight` at the same time. Received: "
            f"class_weight={class_weight} and sample weights in {where} of the data set."
        )
    return x, y, class_weights_to_sample_weights(y, class_weight)


class ArrayBatches:
    """Static-size batches over arrays, gathered one batch at a time: in-memory numpy
    arrays, and memory maps and array-likes on disk (`keras_accel.data.on_disk`), read
    from the disk a batch of rows at a time (`on_disk`: whether any array is)."""

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
        return self.plan.num_batches

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
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        plan = self.plan
        real = int(plan.real_rows[index])
        first, stop, size = 0, real, plan.static_rows
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
        real = plan.real_rows[first : first + count]
        if not (len(real) == count and (real == plan.static_rows).all()):
            return _stacked((self.batch(index) for index in range(first, first + count)), count)
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


def standardize_element(item: Any) -> tuple[Any, Any, Any]:
    """`(x, y, sample_weight)` from what a data set yields: x, (x,), (x, y) or (x, y, w)."""
    if isinstance(item, dict) or not isinstance(item, (tuple, list)):
        return item, None, None
    item = tuple(item)
    if not 1 <= len(item) <= 3:
        raise ValueError(
            "A batch must be x, (x,), (x, y) or (x, y, sample_weight). "
            f"Received a tuple of {len(item)} elements."
        )
    return item + (None,) * (3 - len(item))


def as_numpy_batch(item: Any, where: str) -> tuple[Any, Any, Any]:
    """One batch a user's data set yielded, as numpy `(x, y, sample_weight)`."""
    x, y, sw = standardize_element(item)
    return to_numpy(x, "x"), to_numpy(y, "y"), standardize_sample_weight(sw)


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


class PyDatasetBatches:
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
        return self.count

    def __len__(self) -> int:
        if self.count is None:
            raise TypeError("An infinite PyDataset (num_batches=None) has no length.")
        return self.count

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
        if self.count is not None and not 0 <= index < self.count:
            raise IndexError(f"batch index {index} out of range for {self.count} batches")
        where = self.source_index(index)
        batch = self._read(where)
        self._padder.check(batch, f"Batch {where}")
        return self._padder.pad(batch, scale, self.plan, index)

    def first_batch(self):
        return self.batch(0) if not self.shuffle else self._padder.pad(self._read(0))

    def _read(self, where: int) -> tuple:
        """The user's batch `where` as numpy `(x, y, sample_weight)`, class-weighted."""
        batch = as_numpy_batch(self.source[where], f"batch {where}")
        return _class_weighted(batch, self.class_weight, f"batch {where}")

    def on_epoch_end(self) -> None:
        self.source.on_epoch_end()


def is_generator(value: Any) -> bool:
    """A Python generator, as Keras's `fit` takes one (`types.GeneratorType`)."""
    import types

    return isinstance(value, types.GeneratorType)


def is_grain_dataset(value: Any) -> bool:
    """A Grain `MapDataset`, `IterDataset` or `DataLoader`, found by module name so that
    keras_accel never imports Grain itself."""
    for parent in type(value).__mro__:
        module = parent.__module__ or ""
        if module.split(".")[0] == "grain" and parent.__name__ in (
            "MapDataset",
            "IterDataset",
            "DataLoader",
        ):
            return True
    return False


def is_torch_dataloader(value: Any) -> bool:
    """A `torch.utils.data.DataLoader` (as Keras's torch trainer takes one), found by
    module name so that keras_accel never imports torch for it."""
    return any(
        parent.__name__ == "DataLoader" and (parent.__module__ or "").startswith("torch.")
        for parent in type(value).__mro__
    )


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
            remainder=remainder if training else "pad",
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
        self.plan = StreamPlan(
            batch_size=self._padder.first_rows,
            static_rows=self._padder.static_rows,
            num_batches=length if remainder == "pad" else None,
            infinite=infinite,
            remainder=remainder,
            training=training,
            kind=self.kind,
        )
        self.epoch = 0
        self._started = False

    def first_batch(self):
        return self._padder.pad(as_numpy_batch(self._first, "batch 0"))

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
