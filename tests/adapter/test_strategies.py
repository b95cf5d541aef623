"""Strategy resolution: pure logic over a device inventory (no devices needed)."""

import pytest

from keras_accel.adapter.strategies import STRATEGIES, resolve

CPUS = {"cpu": [f"cpu:{i}" for i in range(8)]}


def test_auto_prefers_tpu_then_gpus_then_cpus():
    inventory = {"tpu": ["tpu:0", "tpu:1"], "gpu": ["gpu:0"], "cpu": ["cpu:0"]}
    assert resolve("auto", inventory).strategy == "tpu"
    del inventory["tpu"]
    plan = resolve("auto", inventory)
    assert (plan.strategy, plan.platform, plan.devices) == ("single", "gpu", ("gpu:0",))
    inventory["gpu"] = ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]
    plan = resolve("auto", inventory)
    assert (plan.strategy, plan.num_replicas) == ("data_parallel", 4)
    plan = resolve("auto", CPUS)
    assert (plan.strategy, plan.platform, plan.num_replicas) == ("data_parallel", "cpu", 8)


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ValueError) as info:
        resolve("mirroredd", CPUS)
    message = str(info.value)
    assert "'mirroredd'" in message
    for name in STRATEGIES:
        assert repr(name) in message


def test_devices_selection_and_errors():
    assert resolve("data_parallel", CPUS, devices=4).devices == tuple(CPUS["cpu"][:4])
    assert resolve("single", CPUS).devices == ("cpu:0",)
    assert resolve("mirrored", CPUS, devices=["cpu:2", "cpu:5"]).num_replicas == 2
    with pytest.raises(ValueError, match="devices=9 but 8 cpu devices exist"):
        resolve("auto", CPUS, devices=9)
    with pytest.raises(ValueError, match="Unknown devices \\['gpu:0'\\]"):
        resolve("auto", CPUS, devices=["gpu:0"])


def test_mesh_shape_must_match_device_count():
    plan = resolve("model_parallel", CPUS, mesh_shape=(2, 4))
    assert plan.mesh_shape == (2, 4) and plan.num_replicas == 2
    with pytest.raises(ValueError, match=r"mesh_shape=\(3, 2\) needs 6 devices but 8"):
        resolve("model_parallel", CPUS, mesh_shape=(3, 2))
    with pytest.raises(ValueError, match="strategy='model_parallel' for a two-axis mesh"):
        resolve("data_parallel", CPUS, mesh_shape=(2, 4))


def test_tpu_without_tpu_is_an_immediate_error():
    with pytest.raises(RuntimeError, match="strategy='tpu' but no TPU was found"):
        resolve("tpu", CPUS)
