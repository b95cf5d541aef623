"""keras_accel: one Keras 3 training script on CPUs, GPUs or TPUs, under JAX or TensorFlow.

The public API is this short list and the subpackages `callbacks`, `data`, `models` and
`schedules`;
everything else is internal.

Example:
    >>> import keras_accel
    >>> acc = keras_accel.Accelerator()
    >>> acc.strategy_name in keras_accel.STRATEGIES
    True
"""

from keras_accel import callbacks, data, models, schedules
from keras_accel.adapter import STRATEGIES, Accelerator
from keras_accel.benchmark import find_batch_size
from keras_accel.utils.devices import configure_virtual_cpu_devices

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "Accelerator",
    "callbacks",
    "configure_virtual_cpu_devices",
    "data",
    "find_batch_size",
    "models",
    "schedules",
    "__version__",
]
