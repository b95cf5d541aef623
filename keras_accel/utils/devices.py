"""Split the host CPU into several logical devices, so distribution runs for real on a laptop."""

from __future__ import annotations

import os

from keras_accel.utils.checks import check_positive_int

_SUPPORTED = ("jax", "tensorflow", "torch", "numpy")


def current_backend() -> str:
    """The Keras backend name, read without importing a backend when possible."""
    import keras

    return keras.backend.backend()


def parse_device_name(name: str) -> tuple[str, int]:
    """`"gpu:3"` -> `("gpu", 3)`: keras_accel's device names, platform and index, as both
    backends' inventories list them."""
    platform, _, index = str(name).partition(":")
    if platform not in ("cpu", "gpu", "tpu") or not index.isdigit():
        raise ValueError(
            f"A device name is a platform and an index, such as 'cpu:0' or 'gpu:3'. "
            f"Received: {name!r}"
        )
    return platform, int(index)


def configure_virtual_cpu_devices(count: int) -> None:
    """Expose the host CPU as `count` logical devices for the active Keras backend.

    Must run before the backend touches a device (before any model is built). JAX gets
    `jax_num_cpu_devices`; TensorFlow gets logical CPU devices. This is how the test suite
    exercises 8-way data parallelism on a 2-core machine. On torch a process is one device:
    `count` must be 1 (several devices are several processes, `keras-accel launch -n N`).

    Args:
        count: number of logical CPU devices, at least 1.

    Example:

    ```python
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(8)  # first thing, before any model
    acc = keras_accel.Accelerator()               # data_parallel over cpu:0 ... cpu:7
    ```
    """
    count = check_positive_int("count", count)
    backend = current_backend()
    if backend == "jax":
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:
            have = len(jax.devices("cpu"))
            if have != count:
                raise RuntimeError(
                    f"JAX already started with {have} CPU devices; cannot switch to "
                    f"count={count}. Call configure_virtual_cpu_devices() before any JAX "
                    "computation."
                ) from None
    elif backend == "tensorflow":
        import tensorflow as tf

        cpus = tf.config.list_physical_devices("CPU")
        try:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
            )
        except RuntimeError:
            have = len(tf.config.list_logical_devices("CPU"))
            if have != count:
                raise RuntimeError(
                    f"TensorFlow already initialized {have} logical CPU devices; cannot "
                    f"switch to count={count}. Call configure_virtual_cpu_devices() before "
                    "any TensorFlow op runs."
                ) from None
    elif backend == "torch" and count != 1:
        # torch has no logical devices: its data parallelism is one process per device.
        raise ValueError(
            f"On the torch backend one process is one device: virtual CPU devices are a JAX "
            f"and TensorFlow feature. Received: count={count}. Start one process per device "
            f"instead (keras-accel launch -n {count} script.py), or leave count at 1."
        )
    elif count != 1:
        raise ValueError(
            f"Virtual CPU devices are supported on the jax and tensorflow backends. "
            f"Received: count={count}, KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r} "
            f"(backend {backend!r})."
        )
