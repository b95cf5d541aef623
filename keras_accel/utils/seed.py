"""Seeding that does what `keras.utils.set_random_seed` does, without importing TensorFlow
on a JAX run (Keras's version imports TensorFlow whenever it is installed)."""

from __future__ import annotations

import random
import sys

import numpy as np


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy, Keras's global seed generator, and the backend."""
    import keras
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
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
