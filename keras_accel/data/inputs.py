"""The inputs an Accelerator accepts, recognised and read: which kind each is (`classify`),
and its arrays and batches as numpy (`to_numpy`, `standardize_element`, `as_numpy_batch`),
sparse inputs densified, array-likes on disk left there. Backend-free: nothing here imports
TensorFlow, torch or Grain.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_accel.data import on_disk

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
