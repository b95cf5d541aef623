"""Keras's losses and metric wrappers: the Keras mask a loss reads from its values (the
module of `keras.losses.Loss.__call__`'s `get_keras_mask`), and the function and arguments a
`LossFunctionWrapper` or `keras.metrics.MeanMetricWrapper` applies."""

from __future__ import annotations

import functools
import inspect
import sys

import keras

from keras_accel.utils.keras_internals.lookup import (
    Internal,
    first,
    globals_of,
    missing,
    module_at,
    require,
)


def _loss_masking():
    """The module of the `get_keras_mask` that `keras.losses.Loss.__call__` reads a loss's
    mask with (3.15 calls `backend.get_keras_mask`, 3.16 imports the function itself): it
    defines `set_keras_mask` beside it."""
    found = globals_of("keras.losses.Loss.__call__", "get_keras_mask")
    via_backend = globals_of("keras.losses.Loss.__call__", "backend")
    function = first(found, lambda: via_backend().get_keras_mask)()
    return sys.modules[function.__module__]


_LOSS_MASKING = first(_loss_masking, module_at("keras.src.backend.common.masking"))

# Checked by `keras_internals.check()` where TensorFlow is the backend.
REQUIRED_TENSORFLOW = [
    Internal(
        "the module of keras.losses.Loss.__call__'s get_keras_mask",
        "get_keras_mask",
        "a loss's mask, kept where its values are rescaled",
        _LOSS_MASKING,
    ),
    Internal(
        "the module of keras.losses.Loss.__call__'s get_keras_mask",
        "set_keras_mask",
        "a loss's mask, kept where its values are rescaled",
        _LOSS_MASKING,
    ),
]


def keras_mask(tensor):
    """The Keras mask a tensor carries (what `keras.losses.Loss` reads from its values)."""
    return _LOSS_MASKING().get_keras_mask(tensor)


def set_keras_mask(tensor, mask) -> None:
    """Give `tensor` the Keras mask `mask` (None: none)."""
    _LOSS_MASKING().set_keras_mask(tensor, mask)


@functools.cache
def _loss_function_wrapper() -> type:
    """Keras's `LossFunctionWrapper` (not exported): the class in the MRO of the public
    `keras.losses.MeanSquaredError` whose `__init__` takes the `fn` it wraps."""
    for cls in keras.losses.MeanSquaredError.__mro__:
        if "fn" in inspect.signature(vars(cls).get("__init__", lambda: None)).parameters:
            return cls
    raise missing(
        "a class in keras.losses.MeanSquaredError.__mro__",
        "__init__(fn)",
        "the function a built-in loss applies",
    )


def wrapped_function(obj):
    """The function a Keras loss or metric wrapper applies: `fn` of a `LossFunctionWrapper`
    (every built-in function loss), `_fn` of a `keras.metrics.MeanMetricWrapper`; None for
    any other object, which wraps nothing."""
    if isinstance(obj, keras.metrics.MeanMetricWrapper):
        return require(obj, "_fn", "the function a metric wrapper applies")
    if isinstance(obj, _loss_function_wrapper()):
        return obj.fn
    return None


def wrapped_kwargs(obj) -> dict:
    """The keyword arguments a Keras loss or metric wrapper passes its function
    (`_fn_kwargs`); {} for any other object."""
    if isinstance(obj, (keras.metrics.MeanMetricWrapper, _loss_function_wrapper())):
        return dict(require(obj, "_fn_kwargs", "the arguments a wrapped loss is called with"))
    return {}
