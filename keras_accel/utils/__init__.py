"""Small helpers shared by the package: device simulation, process facts."""

from keras_accel.utils.devices import configure_virtual_cpu_devices

__all__ = ["configure_virtual_cpu_devices"]
