"""configure_virtual_cpu_devices on torch: one process is one device, and the error says how to
get several."""

import pytest

from keras_accel.utils.devices import configure_virtual_cpu_devices
from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's rule"),
]


def test_one_device_is_fine_on_torch():
    configure_virtual_cpu_devices(1)


def test_several_devices_on_torch_say_to_start_processes():
    with pytest.raises(ValueError, match=r"one process is one device.*Received: count=8") as info:
        configure_virtual_cpu_devices(8)
    assert "keras-accel launch -n 8" in str(info.value)
