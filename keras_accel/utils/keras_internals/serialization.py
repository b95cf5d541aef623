"""Keras's serialization: the lazy `tensorflow` module `serialize_keras_object` asks
(`keras.src.utils.module_utils`), held off where TensorFlow is not imported."""

from __future__ import annotations

import contextlib
import importlib
import sys


@contextlib.contextmanager
def tensorflow_left_unimported():
    """Within: Keras's serialization (`get_config` of a model, a layer, an optimizer) does not
    import TensorFlow on another backend.

    `serialize_keras_object` asks its lazy `tensorflow` module whether TensorFlow is
    installed (`tf.available`, to recognise a `tf.TensorShape`), and asking imports it:
    measured in a torch process, 150 MB of memory and 3 s, for a fingerprint of the model
    (`keras_accel.adapter.choice_cache`). Where TensorFlow is not imported yet no object can
    be one of its types, so the lazy module is told it is unavailable for the duration, and
    put back after (`LazyModule._available`, reset to "not asked yet"). Optional: a Keras
    without that module or attribute is left as it is (TensorFlow imported, as before)."""
    lazy = None
    if "tensorflow" not in sys.modules:
        try:
            lazy = importlib.import_module("keras.src.utils.module_utils").tensorflow
        except (ImportError, AttributeError):
            lazy = None
        if getattr(lazy, "_available", True) is not None:
            lazy = None  # Already asked (or not Keras's lazy module): nothing to hold off.
    if lazy is None:
        yield
        return
    lazy._available = False
    try:
        yield
    finally:
        lazy._available = None  # As it was: asked again at the next use.
