"""keras_accel: one Keras 3 training script on CPUs, GPUs or TPUs, under JAX, TensorFlow or torch.

The public API is this short list and the subpackages `callbacks`, `data`, `models` and
`schedules`;
everything else is internal. Names load on first use, so that a command which needs no
backend (`keras-accel launch`, `--help`) starts without importing one.

Example:
    >>> import keras_accel
    >>> acc = keras_accel.Accelerator()
    >>> acc.strategy_name in keras_accel.STRATEGIES
    True
"""

import importlib

from keras_accel.utils.version import __version__

# name -> the module that defines it (a subpackage is its own module).
_PUBLIC = {
    "STRATEGIES": "keras_accel.adapter.strategies",
    "Accelerator": "keras_accel.adapter.accelerator",
    "callbacks": "keras_accel.callbacks",
    "configure_virtual_cpu_devices": "keras_accel.utils.devices",
    "data": "keras_accel.data",
    "find_batch_size": "keras_accel.benchmark",
    "models": "keras_accel.models",
    "schedules": "keras_accel.schedules",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'keras_accel' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where == f"keras_accel.{name}" else getattr(module, name)
    globals()[name] = value  # Loaded once.
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
