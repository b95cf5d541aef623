"""The CIFAR-10 MLP and CNN of the TPU-vs-GPU seed post, rebuilt exactly, and its compile settings.

The seed (TF 1.11 Keras, 2018) timed these two models by batch size; keras_accel's benchmark
reruns them, so the default architecture here must match the post layer for layer. Keras 3
kept the defaults the post relied on (Dense `glorot_uniform`, BatchNormalization momentum 0.99
and epsilon 1e-3, AveragePooling2D strides = pool size), so building with defaults reproduces it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

# Units of the eight Dense -> BatchNorm -> ReLU -> Dropout(0.5) blocks of the seed MLP.
MLP_UNITS = (2048, 1024, 512, 256, 128, 64, 32, 16)
# Filters of the five Conv2D(3, same) -> BatchNorm -> ReLU blocks of the seed CNN ("AlexNet");
# an AveragePooling2D(2) follows the first and the second block.
CNN_FILTERS = (96, 256, 384, 384, 256)
_CNN_POOL_AFTER = (1, 2)

_RECIPES = ("cifar10", "bert")


def _check_shape(input_shape: Sequence[int], rank: int | None) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in input_shape)
    except TypeError:
        shape = ()
    if not shape or any(d < 1 for d in shape) or (rank is not None and len(shape) != rank):
        want = f"{rank} positive integers" if rank else "positive integers"
        raise ValueError(f"`input_shape` must be {want}. Received: input_shape={input_shape!r}")
    return shape


def _check_common(num_classes: int, width: float) -> None:
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(
            f"`num_classes` must be an integer >= 2. Received: num_classes={num_classes!r}"
        )
    if not isinstance(width, (int, float)) or isinstance(width, bool) or width <= 0:
        raise ValueError(f"`width` must be a positive number. Received: width={width!r}")


def _scaled(size: int, width: float) -> int:
    return max(1, round(size * width))


def _predictions(num_classes: int) -> keras.layers.Dense:
    # float32 output even under a mixed-precision policy: softmax + log in bfloat16 loses the
    # small probabilities the cross-entropy needs. Under the default float32 policy this is
    # exactly the seed's Dense(10, softmax).
    return keras.layers.Dense(
        num_classes, activation="softmax", dtype="float32", name="predictions"
    )


def mlp(
    input_shape: Sequence[int] = (32, 32, 3),
    num_classes: int = 10,
    *,
    width: float = 1.0,
    dropout: float = 0.5,
    name: str = "seed_mlp",
) -> keras.Model:
    """The seed's CIFAR-10 MLP: 8 blocks Dense -> BatchNorm -> ReLU -> Dropout, then softmax.

    Block units are 2048, 1024, 512, 256, 128, 64, 32, 16 (times `width`). The seed fed
    images reshaped to 3072 values; here an image-shaped input is flattened by a `Flatten`
    layer (no weights), so the same model takes `load_cifar10()` images as they are. Pass
    `input_shape=(3072,)` to get the seed's flat input with no `Flatten` layer.

    Args:
        input_shape: shape of one sample, without the batch dimension.
        num_classes: number of output classes.
        width: multiplies every block's units (rounded, at least 1); 1.0 is the seed.
        dropout: dropout rate of every block; 0.5 is the seed.
        name: the model's name.

    Returns:
        A built functional `keras.Model` with named layers (`block{i}_dense`, `block{i}_bn`,
        `block{i}_relu`, `block{i}_dropout` for i = 1..8, and `predictions`).

    Example:
        >>> model = mlp()
        >>> model.count_params()
        9108058
        >>> model.output_shape
        (None, 10)
    """
    shape = _check_shape(input_shape, None)
    _check_common(num_classes, width)
    inputs = keras.Input(shape=shape, name="images")
    x = keras.layers.Flatten(name="flatten")(inputs) if len(shape) > 1 else inputs
    for i, units in enumerate(MLP_UNITS, start=1):
        x = keras.layers.Dense(_scaled(units, width), name=f"block{i}_dense")(x)
        x = keras.layers.BatchNormalization(name=f"block{i}_bn")(x)
        x = keras.layers.Activation("relu", name=f"block{i}_relu")(x)
        x = keras.layers.Dropout(dropout, name=f"block{i}_dropout")(x)
    outputs = _predictions(num_classes)(x)
    return keras.Model(inputs, outputs, name=name)


def cnn(
    input_shape: Sequence[int] = (32, 32, 3),
    num_classes: int = 10,
    *,
    width: float = 1.0,
    name: str = "seed_cnn",
) -> keras.Model:
    """The seed's CIFAR-10 CNN ("AlexNet"): 5 Conv -> BatchNorm -> ReLU blocks, 2 average pools.

    Blocks of Conv2D(c, 3, padding="same") -> BatchNorm -> ReLU with c = 96, AvgPool(2), 256,
    AvgPool(2), 384, 384, 256 (times `width`), then Flatten -> Dense(num_classes, softmax).
    Images are channels-last whatever `keras.config.image_data_format()` says, because
    `load_cifar10()` returns (N, 32, 32, 3).

    Args:
        input_shape: (height, width, channels) of one image.
        num_classes: number of output classes.
        width: multiplies every block's filters (rounded, at least 1); 1.0 is the seed.
        name: the model's name.

    Returns:
        A built functional `keras.Model` with named layers (`block{i}_conv`, `block{i}_bn`,
        `block{i}_relu` for i = 1..5, `pool1`, `pool2`, `flatten`, `predictions`).

    Example:
        >>> model = cnn()
        >>> model.count_params()
        3491082
        >>> model.get_layer("pool2").output.shape
        (None, 8, 8, 256)
    """
    shape = _check_shape(input_shape, 3)
    _check_common(num_classes, width)
    inputs = keras.Input(shape=shape, name="images")
    x = inputs
    for i, filters in enumerate(CNN_FILTERS, start=1):
        x = keras.layers.Conv2D(
            _scaled(filters, width),
            3,
            padding="same",
            data_format="channels_last",
            name=f"block{i}_conv",
        )(x)
        x = keras.layers.BatchNormalization(axis=-1, name=f"block{i}_bn")(x)
        x = keras.layers.Activation("relu", name=f"block{i}_relu")(x)
        if i in _CNN_POOL_AFTER:
            pool = _CNN_POOL_AFTER.index(i) + 1
            x = keras.layers.AveragePooling2D(2, data_format="channels_last", name=f"pool{pool}")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    outputs = _predictions(num_classes)(x)
    return keras.Model(inputs, outputs, name=name)


def seed_compile_kwargs(recipe: str = "cifar10", *, learning_rate: float | None = None) -> dict:
    """The optimizer, loss and metrics a seed used, as keyword arguments for `Model.compile`.

    A fresh optimizer is made on every call, so the result can be used inside a
    distribution scope (`tf.distribute` wants the optimizer's variables created there).

    Recipes:
        - `"cifar10"`: Adam(1e-3), categorical cross-entropy on one-hot labels, accuracy
          (the MLP/CNN benchmark seed).
        - `"bert"`: Adam(3e-5, epsilon=1e-8), sparse categorical cross-entropy on logits,
          accuracy (the BERT seed).

    Args:
        recipe: `"cifar10"` or `"bert"`.
        learning_rate: overrides the recipe's learning rate.

    Returns:
        A dict with `optimizer`, `loss` and `metrics`.

    Example:
        >>> kwargs = seed_compile_kwargs("cifar10")
        >>> kwargs["loss"], kwargs["metrics"]
        ('categorical_crossentropy', ['accuracy'])
    """
    if recipe == "cifar10":
        lr = 1e-3 if learning_rate is None else learning_rate
        return {
            "optimizer": keras.optimizers.Adam(learning_rate=lr),
            "loss": "categorical_crossentropy",
            "metrics": ["accuracy"],
        }
    if recipe == "bert":
        lr = 3e-5 if learning_rate is None else learning_rate
        return {
            "optimizer": keras.optimizers.Adam(learning_rate=lr, epsilon=1e-8),
            "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": ["accuracy"],
        }
    raise ValueError(
        f"Unknown recipe. Valid recipes: {list(_RECIPES)}. Received: recipe={recipe!r}"
    )


def compile_seed(
    model: keras.Model,
    recipe: str = "cifar10",
    *,
    learning_rate: float | None = None,
    **compile_kwargs: Any,
) -> keras.Model:
    """Compile `model` with a seed's settings (see `seed_compile_kwargs`) and return it.

    The `"cifar10"` recipe expects one-hot labels, as `load_cifar10(one_hot=True)` returns.

    Args:
        model: the model to compile.
        recipe: `"cifar10"` (default) or `"bert"`.
        learning_rate: overrides the recipe's learning rate.
        **compile_kwargs: passed on to `model.compile` (e.g. `steps_per_execution`,
            `jit_compile`); they may also replace `optimizer`, `loss` or `metrics`.

    Returns:
        The same model, compiled.

    Example:
        >>> model = compile_seed(mlp(width=0.01))
        >>> model.loss
        'categorical_crossentropy'
    """
    kwargs = seed_compile_kwargs(recipe, learning_rate=learning_rate)
    kwargs.update(compile_kwargs)
    model.compile(**kwargs)
    return model
