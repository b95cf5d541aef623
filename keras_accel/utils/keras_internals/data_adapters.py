"""Keras's data adapters: the `DataAdapter` base (beside `keras.utils.PyDataset`'s adapter),
the `get_data_adapter` its TF epoch iterator calls, and Keras 3.16's `data_adapter_utils`
(stacked groups of batches for `steps_per_execution` on JAX)."""

from __future__ import annotations

import inspect
import sys

from keras_accel.utils.keras_internals.lookup import (
    Internal,
    first,
    holder,
    missing,
    module_at,
    module_of,
    module_of_class,
)
from keras_accel.utils.keras_internals.trainers import BACKEND_TRAINER


def _data_adapters():
    """The package whose `get_data_adapter` Keras's epoch iterator calls, as a module
    attribute: the `data_adapters` of the module of a class in the TF trainer module's
    `TFEpochIterator` MRO (its base, `EpochIterator`)."""
    mro = module_of_class(BACKEND_TRAINER)().TFEpochIterator.__mro__
    return next(
        sys.modules[c.__module__].data_adapters
        for c in mro
        if hasattr(sys.modules[c.__module__], "data_adapters")
    )


# keras_accel.data.grain: a Grain data set reaches Keras as a DataAdapter of ours (Keras's
# get_data_adapter takes any DataAdapter as it is), a fresh pass every epoch.
DATA_ADAPTER = Internal(
    "keras.utils.PyDataset's module",
    "DataAdapter",
    "Grain inputs, a fresh pass every epoch",
    first(
        module_of("keras.utils.PyDataset"),
        module_at("keras.src.trainers.data_adapters.data_adapter"),
    ),
)
GET_DATA_ADAPTER = Internal(
    "the data adapters package of the TF trainer's epoch iterator",
    "get_data_adapter",
    "a PyDataset or a generator over several TF replicas",
    first(_data_adapters, module_at("keras.src.trainers.data_adapters")),
)
# Checked by `keras_internals.check()`; the second where TensorFlow is the backend.
REQUIRED = [DATA_ADAPTER]
REQUIRED_TENSORFLOW = [GET_DATA_ADAPTER]


def data_adapter_class() -> type:
    """Keras's `DataAdapter` base class (what `get_data_adapter` passes through as it is),
    found beside `keras.utils.PyDataset`'s adapter."""
    return holder(DATA_ADAPTER).DataAdapter


def get_data_adapter():
    """Keras's `get_data_adapter`: the adapter its trainers make for an input (a
    `PyDataset`'s, a generator's), so that keras_accel can hand the TF trainer that input's
    pipeline already distributed (`keras_accel.adapter.backends.tensorflow.runtime.
    KerasRouteAdapter`)."""
    return holder(GET_DATA_ADAPTER).get_data_adapter


def keras_scans_steps() -> bool:
    """Whether Keras's own JAX trainer runs `steps_per_execution` > 1 steps in one compiled
    scan (Keras 3.16: keras-team/keras#23527), rather than as a host loop of the one-step
    program (Keras 3.15). Read from the public contract that release changed: its
    `DataAdapter.get_jax_iterator(super_batch=None)` asks an adapter for stacked groups."""
    get_jax_iterator = data_adapter_class().get_jax_iterator
    return "super_batch" in inspect.signature(get_jax_iterator).parameters


def _data_adapter_utils():
    """Keras's `data_adapter_utils`, found beside `keras.utils.PyDataset`'s adapter (which
    stacks its groups with it); None where that module does not import it."""
    return getattr(module_of("keras.utils.PyDataset")(), "data_adapter_utils", None)


def super_batch_iterator():
    """Keras 3.16's `data_adapter_utils.super_batch_iterator`: N batches stacked into one,
    the short last group as a `PartialBatchList` (what its JAX trainer tells apart). Keras
    has no public name for either. Only a Keras that asks (`keras_scans_steps()`) gets here,
    so it is not in the checked list, which 3.15 must pass."""
    function = getattr(_data_adapter_utils(), "super_batch_iterator", None)
    if function is None:
        raise missing(
            "keras.utils.PyDataset's module",
            "data_adapter_utils.super_batch_iterator",
            "steps_per_execution > 1 on JAX",
        )
    return function


def is_partial_batch_list(item) -> bool:
    """Whether `item` is Keras 3.16's `PartialBatchList`: the batches of a short last group,
    which its JAX epoch iterator yields as a list where full groups come stacked."""
    kind = getattr(_data_adapter_utils(), "PartialBatchList", None)
    return kind is not None and isinstance(item, kind)
