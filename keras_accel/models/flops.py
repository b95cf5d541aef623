"""Analytic FLOP counts of Dense and convolution layers, for model FLOPs utilisation (MFU).

Counting from layer shapes, not from a profiler, gives the same number on every backend and
device, which is what an MFU comparison between a TPU, a GPU and a CPU run needs.
"""

from __future__ import annotations

import math

import keras

from keras_accel.utils import keras_internals
from keras_accel.utils.checks import check_positive_int

# Training = forward + backward, and the backward pass of a matmul or convolution costs two of
# them (gradient with respect to the input, and with respect to the weights): ~3x forward.
TRAINING_MULTIPLIER = 3


def _leaf_layers(model: keras.Model):
    """Every layer of `model`, with nested models expanded in place."""
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _leaf_layers(layer)
        else:
            yield layer


def _static_shape(layer: keras.layers.Layer, which: str) -> tuple:
    # `layer.input` silently answers with the first call of a shared layer, which would
    # count it once; refuse instead of under-counting.
    calls = len(keras_internals.inbound_nodes(layer))
    if calls > 1:
        raise ValueError(
            f"Cannot count FLOPs of layer {layer.name!r}: it is called {calls} times (a shared "
            "layer); the layer must be called exactly once in a functional or Sequential model."
        )
    try:
        tensor = getattr(layer, which)
    except (AttributeError, ValueError) as error:
        # Raised for layers never called symbolically (subclassed models) or called several
        # times (shared layers): the shape of "the" input is then undefined.
        raise ValueError(
            f"Cannot count FLOPs of layer {layer.name!r}: its {which} shape is not defined "
            "(the layer must be called exactly once in a functional or Sequential model that "
            f"has an Input). Received: layer={layer.__class__.__name__}, error={error}"
        ) from None
    shape = tuple(tensor.shape)
    if any(d is None for d in shape[1:]):
        raise ValueError(
            f"Cannot count FLOPs of layer {layer.name!r}: its {which} shape {shape} has "
            "unknown non-batch dimensions. Build the model with a fully defined input shape."
        )
    return shape


def _layer_macs(layer: keras.layers.Layer) -> int:
    """Multiply-accumulates of one sample through `layer`; 0 for layers not counted."""
    if isinstance(layer, keras.layers.Dense):
        # A Dense on a rank > 2 input applies its kernel at every leading position.
        positions = math.prod(_static_shape(layer, "input")[1:-1])
        return positions * math.prod(layer.kernel.shape)
    if isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)):
        # Kernel (*window, in_channels / groups, filters): each output position does one MAC
        # per kernel entry. The output's spatial size already reflects strides and padding.
        out = _static_shape(layer, "output")
        channels_last = layer.data_format == "channels_last"
        spatial = out[1:-1] if channels_last else out[2:]
        return math.prod(spatial) * math.prod(layer.kernel.shape)
    return 0


def forward_flops(model: keras.Model, batch_size: int = 1) -> int:
    """FLOPs of one forward pass: 2 x multiply-accumulates of every Dense and Conv layer.

    Biases, normalisation, activations, pooling and attention score products are not counted:
    they are a small share for the seed models and not matrix-unit work. For models built
    mostly from other layers (e.g. BERT's attention) the result is a lower bound.

    Args:
        model: a built functional or Sequential model (nested models are counted too).
        batch_size: number of samples.

    Returns:
        The FLOP count, an int.

    Example:
        >>> import keras
        >>> inputs = keras.Input((4,))
        >>> model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        >>> forward_flops(model, batch_size=2)
        48
    """
    _check_batch_size(batch_size)
    return 2 * batch_size * sum(_layer_macs(layer) for layer in _leaf_layers(model))


def training_flops(model: keras.Model, batch_size: int) -> int:
    """FLOPs of one training step on `batch_size` samples: ~3 x `forward_flops`.

    Divide by the step time and the device's peak FLOP/s to get the MFU.

    Args:
        model: a built functional or Sequential model.
        batch_size: global batch size of the step.

    Returns:
        The FLOP count, an int.

    Example:
        >>> import keras
        >>> inputs = keras.Input((4,))
        >>> model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        >>> training_flops(model, batch_size=2)
        144
    """
    return TRAINING_MULTIPLIER * forward_flops(model, batch_size)


def _check_batch_size(batch_size: int) -> None:
    check_positive_int("batch_size", batch_size)
