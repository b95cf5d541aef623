"""Helpers below every other layer: process and cluster facts, devices (and their simulation
on CPUs), printing, seeding, and the internals of Keras (`keras_internals`) and of the other
libraries (`library_internals`), each listed with its reason and checked."""

from keras_accel.utils.devices import configure_virtual_cpu_devices

__all__ = ["configure_virtual_cpu_devices"]
