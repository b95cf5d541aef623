"""The inputs an Accelerator accepts, each turned into a sequence of static-size padded batches.

- numpy arrays (and tuples, lists or dicts of them; strings included): batched, shuffled and
  padded here, one batch at a time, so the data set is never copied whole;
- `keras.utils.PyDataset`: each of its batches is padded to the size of its first batch
  (rounded up to a multiple of the replica count);
- `tf.data.Dataset` (where TensorFlow is installed): see `keras_accel.data.tfdata`.

A "batches" object here is backend-free: it has a `plan` (`keras_accel.data.batching.
BatchPlan`), answers `len()` and `batch(index)` with `(x, y, sample_weight, row_mask)` numpy
tuples, has an `epoch` counter (which `Accelerator.fit` sets at each epoch's start, so
shuffling is a function of the epoch and resumes exactly) and an `on_epoch_end()`. The backend
modules wrap it in what `model.fit` takes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from keras_accel.data.batching import (
    BatchPlan,
    check_same_length,
    map_structure,
    num_rows,
    pad_batch,
    static_batch_size,
)

SUPPORTED_INPUTS = (
    "numpy arrays (or tuples, lists, dicts of them; numbers or strings), "
    "keras.utils.PyDataset, tf.data.Dataset"
)


def is_tf_dataset(value: Any) -> bool:
    # Checked by module name so that a JAX-only install never imports TensorFlow here.
    module = type(value).__module__ or ""
    return module.startswith("tensorflow") and hasattr(value, "element_spec")


def is_py_dataset(value: Any) -> bool:
    import keras

    return isinstance(value, keras.utils.PyDataset)


def is_array_input(value: Any) -> bool:
    return not (is_py_dataset(value) or is_tf_dataset(value))


def to_numpy(structure: Any, name: str) -> Any:
    """Every leaf as a numpy array (tensors of any backend, nested lists of numbers or
    strings). A list of arrays is a list of inputs; a list of plain values is one array, as
    Keras reads them."""
    if structure is None:
        return None
    if isinstance(structure, dict):
        return {key: to_numpy(value, name) for key, value in structure.items()}
    if isinstance(structure, (list, tuple)):
        if structure and not any(_is_leaf_array(item) for item in structure):
            return np.asarray(structure)
        return type(structure)(to_numpy(item, name) for item in structure)
    if isinstance(structure, np.ndarray):
        return structure
    if hasattr(structure, "numpy") and callable(structure.numpy):  # tf.Tensor, strings too
        return np.asarray(structure.numpy())
    if hasattr(structure, "__array__") or isinstance(structure, (float, int, str, bytes)):
        return np.asarray(structure)
    raise TypeError(
        f"`{name}` must be numpy arrays or array-likes (or a tuple/list/dict of them). "
        f"Received: {type(structure).__name__}. Supported inputs: {SUPPORTED_INPUTS}."
    )


def _is_leaf_array(item: Any) -> bool:
    return isinstance(item, dict) or hasattr(item, "shape") or hasattr(item, "numpy")


def standardize_sample_weight(sample_weight: Any) -> np.ndarray | None:
    """A float32 weight array of one weight per row (`(N,)`, `(N, 1)` or per timestep)."""
    if sample_weight is None:
        return None
    weights = np.asarray(sample_weight, dtype="float32")
    if weights.ndim == 0:
        raise ValueError(
            "`sample_weight` must hold one weight per row: an array of shape (N,) or (N, 1) "
            f"(or (N, timesteps) for per-timestep losses). Received: a scalar {weights!r}."
        )
    return weights


def class_weights_to_sample_weights(y: np.ndarray, class_weight: dict) -> np.ndarray:
    """Per-row weights from a `{class_index: weight}` dict, for integer or one-hot targets."""
    if y is None or isinstance(y, (dict, list, tuple)):
        raise ValueError(
            "`class_weight` needs a single array of targets. "
            f"Received: y of type {type(y).__name__}."
        )
    labels = np.argmax(y, axis=-1) if y.ndim > 1 and y.shape[-1] > 1 else y.reshape(len(y))
    labels = labels.astype("int64")
    unknown = sorted(set(np.unique(labels).tolist()) - set(class_weight))
    if unknown:
        raise ValueError(
            f"`class_weight` has no weight for classes {unknown[:10]}. "
            f"Received: class_weight keys {sorted(class_weight)}."
        )
    table = np.zeros(max(max(class_weight), labels.max()) + 1, "float32")
    for key, weight in class_weight.items():
        table[int(key)] = weight
    return table[labels]


class ArrayBatches:
    """Static-size batches over in-memory arrays, gathered one batch at a time."""

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
        x = to_numpy(x, "x")
        y = to_numpy(y, "y")
        sample_weight = standardize_sample_weight(sample_weight)
        num_samples = check_same_length([("x", x), ("y", y), ("sample_weight", sample_weight)])
        if class_weight is not None:
            if sample_weight is not None:
                raise ValueError(
                    "Pass either `class_weight` or `sample_weight`, not both. "
                    f"Received: class_weight={class_weight} and a sample_weight array."
                )
            sample_weight = class_weights_to_sample_weights(y, class_weight)
        self.x, self.y, self.sample_weight = x, y, sample_weight
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
        return self.y is not None

    @property
    def weighted(self) -> bool:
        """Whether the user gave weights (sample_weight or class_weight)."""
        return self.sample_weight is not None

    def __len__(self) -> int:
        return self.plan.num_batches

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

    def batch(self, index: int, epoch: int | None = None) -> tuple[Any, Any, Any, Any]:
        """Padded batch `index` of `epoch` (default: the current `self.epoch`):
        `(x, y, sample_weight, row_mask)`."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        plan = self.plan
        start = index * plan.batch_size
        order = self.epoch_indices(self.epoch if epoch is None else epoch)
        indices = order[start : start + int(plan.real_rows[index])]
        # Contiguous ranges are sliced, not fancy-indexed: a view instead of a copy.
        if not self.shuffle:
            take = lambda a: a[indices[0] : indices[-1] + 1]  # noqa: E731
        else:
            take = lambda a: np.take(a, indices, axis=0)  # noqa: E731
        sw = None if self.sample_weight is None else take(self.sample_weight)
        return pad_batch(
            map_structure(take, self.x),
            map_structure(take, self.y),
            sw,
            plan.static_rows,
            plan.weight_scales[index],
        )


def sample_batch(batches) -> tuple[Any, Any, Any, Any]:
    """The first padded batch of `batches` as numpy: `(x, y, sample_weight, row_mask)`.

    For what has to be known of the data before a step is compiled (which accuracy a
    compiled "accuracy" means; whether a user's loss returns one value per row)."""
    if hasattr(batches, "batch"):
        return batches.batch(0)
    import keras

    from keras_accel.data.batching import unpack

    element = next(iter(batches.pipeline(carry_mask=True).take(1)))
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


class PyDatasetBatches:
    """Pads every batch of a user's `keras.utils.PyDataset` to one static size.

    The static size is the first batch's row count rounded up to a replica multiple. Batches
    other than the last must all have that first size; the last may be smaller. To weight
    evaluation exactly the total row count is needed, so the last batch is read once up
    front (one extra batch load).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_replicas: int,
        remainder: str = "pad",
        training: bool = True,
    ):
        self.source = dataset
        count = dataset.num_batches
        if count is None:
            raise ValueError(
                "An infinite PyDataset (num_batches=None) has no last batch to pad and no "
                "length to weight by. Give it a __len__, or pass steps to keras directly."
            )
        if count < 1:
            raise ValueError(f"The PyDataset is empty. Received: len(dataset)={count}")
        x0, y0, sw0 = standardize_element(dataset[0])
        first = num_rows(x0)
        last = first if count == 1 else num_rows(standardize_element(dataset[count - 1])[0])
        self.first_rows = first
        self.has_targets = y0 is not None
        self.weighted = sw0 is not None
        self.plan = BatchPlan(
            num_samples=(count - 1) * first + last,
            batch_size=first,
            static_rows=static_batch_size(first, num_replicas),
            remainder=remainder,
            training=training,
        )
        self.epoch = 0  # The user's PyDataset shuffles itself, in its on_epoch_end().

    def __len__(self) -> int:
        return self.plan.num_batches

    def batch(self, index: int, epoch: int | None = None) -> tuple[Any, Any, Any, Any]:
        x, y, sw = standardize_element(self.source[index])
        x, y = to_numpy(x, "x"), to_numpy(y, "y")
        rows = num_rows(x)
        if rows != self.first_rows and index != self.source.num_batches - 1:
            raise ValueError(
                f"Batch {index} of the PyDataset has {rows} rows but its first batch has "
                f"{self.first_rows}. keras_accel pads only the last batch of a PyDataset: "
                "make every other batch the same size."
            )
        sw = standardize_sample_weight(sw)
        return pad_batch(x, y, sw, self.plan.static_rows, self.plan.weight_scales[index])

    def on_epoch_end(self) -> None:
        self.source.on_epoch_end()
