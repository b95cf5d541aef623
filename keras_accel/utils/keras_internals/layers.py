"""Keras's layers: a model's nested layers (`Layer._flatten_layers`), a layer's graph nodes
and `call` signature (set in `Operation.__init__` and `Layer.__init__`), and
BatchNormalization's batch moments."""

from __future__ import annotations

from collections.abc import Callable

from keras_accel.utils.keras_internals.lookup import Internal, public, require

# Checked by `keras_internals.check()`.
REQUIRED = [
    Internal(
        "keras.layers.Layer",
        "_flatten_layers",
        "finding BatchNormalization layers",
        public("keras.layers.Layer"),
    ),
    Internal(
        "keras.layers.BatchNormalization",
        "_moments",
        "BatchNormalization over real rows",
        public("keras.layers.BatchNormalization"),
    ),
]
# Instance attributes of a layer (a model is one), checked on the model by
# `keras_internals.check_model` as part of `trainers.MODEL_ATTRIBUTES`.
LAYER_ATTRIBUTES = {
    "_inbound_nodes": "a layer's calls",
    "_call_has_training_arg": "whether a layer's call takes `training`",
}


def flatten_layers(model, include_self: bool = True) -> list:
    """Every layer of `model`, nested models included."""
    flatten = require(model, "_flatten_layers", "finding the layers of a model")
    return list(flatten(include_self=include_self, recursive=True))


def inbound_nodes(layer) -> list:
    """The graph nodes of each call of `layer` in a functional model (`layer._inbound_nodes`;
    more than one for a shared layer)."""
    return list(require(layer, "_inbound_nodes", LAYER_ATTRIBUTES["_inbound_nodes"]))


def call_has_training_arg(model) -> bool:
    """Whether the model's `call` takes `training` (Keras's steps pass it only then)."""
    return require(model, "_call_has_training_arg", LAYER_ATTRIBUTES["_call_has_training_arg"])


def batchnorm_reduction_axes(layer) -> list:
    """The axes a BatchNormalization layer averages over (`_reduction_axes`, set when it is
    built)."""
    return require(layer, "_reduction_axes", "BatchNormalization's axes")


def batchnorm_moments(layer) -> Callable:
    """A BatchNormalization layer's `_moments(inputs, mask)`: its batch mean and variance."""
    return require(layer, "_moments", "BatchNormalization over real rows")


def replace_batchnorm_moments(patches, layer, moments: Callable) -> None:
    """For the duration of `patches`, `layer` computes its batch moments with
    `moments(inputs, mask)` (a bound method)."""
    batchnorm_moments(layer)
    patches.set(layer, "_moments", moments)
