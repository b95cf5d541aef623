"""The adapter: maps one Keras script onto JAX device meshes or tf.distribute strategies."""

from keras_accel.adapter.accelerator import Accelerator
from keras_accel.adapter.strategies import STRATEGIES

__all__ = ["Accelerator", "STRATEGIES"]
