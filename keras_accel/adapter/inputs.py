"""A call's inputs standardized and checked, before anything is batched: array inputs as
numpy (or as they lie on disk), a one-input model's `[x]` as `x`, text targets refused with
the fix, `validation_split` and `validation_data` in Keras's forms, and the first batch as
the model's step sees it (for Keras's symbolic build, where a variable is still unbuilt)."""

from __future__ import annotations

import keras
import numpy as np

from keras_accel.adapter.pipeline import preprocessor
from keras_accel.adapter.steps import StepContract, overrides_any_step
from keras_accel.data import on_disk, sources
from keras_accel.data.batching import flatten, map_structure, unpack


def standardize(model, x):
    """`(x, kind)`: what `x` is (`sources.classify`, once: the feeder takes it as it is), and
    array inputs as numpy; `[x]` or `(x,)` for a model with one input is `x`, as Keras's
    functional models read it (a one-element list of inputs would otherwise be a structure
    of its own)."""
    kind = sources.classify(x)
    if x is None or kind != sources.ARRAYS:
        return x, kind
    x = sources.to_numpy(x, "x")
    if isinstance(x, (list, tuple)) and len(x) == 1 and sources.is_array_input(x[0]):
        inputs = getattr(model, "inputs", None)
        try:
            single = inputs is not None and len(inputs) == 1
        except (TypeError, ValueError, AttributeError):
            single = False
        if single and hasattr(x[0], "shape"):
            return x[0], kind
    return x, kind


def check_text_targets(model, y, where: str) -> None:
    """Targets must be numbers for a compiled loss: text targets would otherwise fail inside
    the model's build with the backend's own words (JAX's "data type 'string' not
    understood", torch's `KeyError: 'string'`, TF's "Cast string to float"). A step of the
    user's may read text itself, and a keras-hub preprocessor maps its own targets."""
    if y is None or overrides_any_step(model) or preprocessor(model) is not None:
        return
    leaves = keras.tree.flatten(y)
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "OUS":
            if leaf.dtype.kind == "O" and not any(isinstance(v, (str, bytes)) for v in leaf.flat):
                continue
            shown = str(leaf.dtype)
        elif getattr(dtype, "name", None) == "string":  # A tf.string tensor.
            shown = "string"
        elif isinstance(leaf, (str, bytes)):  # A list of labels.
            shown, leaf = type(leaf).__name__, leaves
        else:
            continue
        first = np.asarray(leaf).reshape(-1)[:3].tolist()
        raise ValueError(
            f"The targets are text, which the loss of {type(model).__name__} {model.name!r} "
            f"cannot compare with its predictions. Received: {where} of dtype {shown} "
            f"(first values {first}). Map the labels to integers before training: a "
            "`keras.layers.StringLookup(num_oov_indices=0)` adapted to them, on the arrays "
            "(`y = lookup(y)`) or in the data pipeline (`ds.map(lambda x, y: (x, lookup(y)))`), "
            "or `np.unique(y, return_inverse=True)[1]`."
        )


def validation_data(data):
    """`(x, y, sample_weight)` of `fit`'s `validation_data`, in any of Keras's forms."""
    if isinstance(data, (tuple, list)):
        # Keras's forms: (x,) (a model that makes its own targets), (x, y), (x, y, w).
        if len(data) not in (1, 2, 3):
            raise ValueError(
                "validation_data must be (x,), (x, y), (x, y, sample_weight) or a data set. "
                f"Received a tuple of {len(data)} elements."
            )
        return (*data, None, None)[:3]
    return data, None, None


def split(x, y, sample_weight, fraction: float, kind: str, validation_data):
    """`((x, y, sample_weight), validation_data)`: the rows to train on and, as
    `validation_data`, the last `fraction` of them (Keras's `validation_split`: the last
    rows, before shuffling), as views read with the batches."""
    if validation_data is not None:
        raise ValueError(
            "Pass either validation_split or validation_data, not both. Received: "
            f"validation_split={fraction} and validation_data."
        )
    if kind != sources.ARRAYS:
        raise ValueError(
            "validation_split works on arrays only (as in Keras). Received x of type "
            f"{type(x).__name__}; pass validation_data instead."
        )
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"validation_split must be in (0, 1). Received: validation_split={fraction}"
        )
    total = next(int(np.shape(a)[0]) for a in flatten(x) if a is not None)
    cut = int(total * (1.0 - fraction))  # Keras takes the *last* fraction, before shuffling.
    # Views, read with the batches: numpy slices (of a memory map too), and row ranges of
    # an array-like on disk, which slicing would read whole (`on_disk.rows_of`).
    head = lambda a: on_disk.rows_of(a, 0, cut)  # noqa: E731
    tail = lambda a: on_disk.rows_of(a, cut, total)  # noqa: E731
    sw = sample_weight
    if sw is not None and not on_disk.on_disk(sw):
        sw = np.asarray(sw)
    return (
        (map_structure(head, x), map_structure(head, y), None if sw is None else head(sw)),
        (map_structure(tail, x), map_structure(tail, y), None if sw is None else tail(sw)),
    )


def first_batch(data, batches, contract: StepContract, model=None):
    """The first batch of `data` as the model's step sees it (arrays, or tf.data tensors),
    for Keras's symbolic build; text is described as a "string" tensor, which Keras reads
    where numpy's `str`/`object` dtypes are refused."""
    data = getattr(data, "keras_accel_local", data)  # A worker's share of distributed data.
    if hasattr(data, "keras_accel_first_batch"):  # A stream of passes (Grain, own files).
        x, y, sample_weight, _ = data.keras_accel_first_batch()
    elif isinstance(data, keras.utils.PyDataset):
        x, y, sample_weight, _ = unpack(data[0])
    elif sources.is_generator(data):  # A stream: its first batch was kept aside.
        x, y, sample_weight, _ = batches.first_batch()
    else:  # A tf.data.Dataset.
        x, y, sample_weight, _ = unpack(next(iter(data.take(1))))
    if model is not None:
        check_text_targets(model, y, "the first batch's y")
    x, y, sample_weight = keras.tree.map_structure(_symbolic_text, (x, y, sample_weight))
    if y is None:
        return (x,)
    if not contract.user_weighted:
        # Only the row mask, shaped in the step by each loss's rank (`_weighted`): building
        # needs no weights, and a row's weight of shape (rows,) cannot meet a loss with one
        # value per time step.
        sample_weight = None
    return (x, y, sample_weight) if contract.pass_weights else (x, y)


def _symbolic_text(leaf):
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "OUS":
        return keras.KerasTensor(leaf.shape, "string")
    return leaf
