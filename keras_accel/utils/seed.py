"""Seeding that does what `keras.utils.set_random_seed` does, without importing TensorFlow
on a JAX run (Keras's version imports TensorFlow whenever it is installed)."""

from __future__ import annotations

import random
import sys

import numpy as np


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy, Keras's global seed generator, and the backend."""
    import keras

    from keras_accel.utils import keras_internals

    keras_internals.check()
    keras_internals.set_global_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    backend = keras.backend.backend()
    # tf.data shuffles are seeded too, but only where TensorFlow is in use already.
    if backend == "tensorflow" or "tensorflow" in sys.modules:
        import tensorflow as tf

        tf.random.set_seed(seed)
    if backend == "torch":
        import torch

        torch.manual_seed(seed)
