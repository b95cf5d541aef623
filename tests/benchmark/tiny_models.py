"""Small models for the benchmark tests: they compile in about a second in a child process."""

import keras


def wide_conv():
    """One wide convolution on CIFAR-10 images: ~0.5 MiB of activations per sample, so a
    batch of a few thousand needs gigabytes (a real out-of-memory under a small limit)."""
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs, name="wide_conv")
