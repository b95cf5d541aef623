"""The strategy registry: one entry per name, a builder per backend, and a user's own entry
trained through the Accelerator like a built-in one."""

import dataclasses

import keras
import numpy as np
import pytest

from keras_accel import STRATEGIES, Accelerator
from keras_accel.adapter.strategies import BUILT_IN, StrategyRegistry, resolve
from tests.helpers import (
    FEW_REPLICAS,
    Batches,
    assert_weights_close,
    compiled_mlp,
    data,
    weights_of,
)

CPUS = {"cpu": [f"cpu:{i}" for i in range(8)]}


@pytest.fixture
def registry():
    registry = StrategyRegistry()
    registry.register("single", "one device")
    registry.register("pair", "a (data, model) mesh", mesh="data_model")
    return registry


def test_the_registry_maps_names_to_descriptions():
    assert STRATEGIES["single"] == "one device, no distribution"
    assert list(STRATEGIES)[:2] == ["auto", "single"] and len(STRATEGIES) == len(BUILT_IN)
    assert STRATEGIES.entry("tpu").platform == "tpu"
    assert STRATEGIES.entry("model_parallel").mesh == "data_model"


def test_each_backend_registers_a_builder_for_every_name_but_auto(backend):
    Accelerator(strategy="single")  # Loads this backend's module, which registers its own.
    missing = [n for n in BUILT_IN if n != "auto" and backend not in STRATEGIES.entry(n).builders]
    assert not missing
    assert not STRATEGIES.entry("auto").builders  # "auto" resolves to another name first.


@pytest.mark.torch
def test_each_backend_runs_every_name_it_builds_under_its_own_runtime_class(backend):
    """A strategy's behaviour is a class the registry hands back per (backend, name): the
    names that behave alike share the base runtime, the others subclass it."""
    from keras_accel.adapter import backends
    from keras_accel.adapter.runtime import Runtime

    module = backends.load(backend)
    built = [n for n in BUILT_IN if backend in STRATEGIES.entry(n).runs_on]
    runtimes = {n: STRATEGIES.runtime_class(n, backend, None) for n in built}
    assert all(isinstance(c, type) and issubclass(c, module.Runtime) for c in runtimes.values())
    assert issubclass(module.Runtime, Runtime)
    assert runtimes["single"] is module.Runtime
    if backend == "tensorflow":
        from keras_accel.adapter.backends.tensorflow.multi_worker import MultiWorkerRuntime
        from keras_accel.adapter.backends.tensorflow.tpu import TPURuntime

        assert runtimes["data_parallel"] is runtimes["mirrored"] is module.Runtime
        assert (runtimes["multi_worker"], runtimes["tpu"]) == (MultiWorkerRuntime, TPURuntime)
    elif backend == "torch":
        from keras_accel.adapter.backends.torch.data_parallel import DataParallelRuntime

        assert runtimes["data_parallel"] is DataParallelRuntime
    else:  # One global-view program runs every Distribution.
        assert set(runtimes.values()) == {module.Runtime}


def test_an_accelerator_runs_its_strategys_runtime_class(backend):
    acc = Accelerator(strategy="data_parallel", devices=FEW_REPLICAS)
    assert type(acc._runtime) is STRATEGIES.runtime_class("data_parallel", backend, None)


def test_runtimes_register_per_backend_and_a_user_strategy_falls_back(registry):
    class Base:
        pass

    class Mine(Base):
        pass

    class Theirs(Base):
        pass

    assert registry.runtime_class("single", "jax", Base) is Base  # None registered.
    registry.runtime("single", "jax")(Mine)
    registry.runtime("single", "jax", default=True)(Theirs)  # A backend loading later.
    assert registry.runtime_class("single", "jax", Base) is Mine
    registry.register("single", "one device, again", override=True)
    assert registry.runtime_class("single", "jax", Base) is Mine  # An override keeps it.
    with pytest.raises(TypeError, match="must be a class.*Received: 3 for torch='single'"):
        registry.runtime("single", "torch")(3)
    with pytest.raises(ValueError, match="Received: strategy='singel'"):
        registry.runtime("singel", "jax")


def test_register_refuses_bad_entries(registry):
    with pytest.raises(ValueError, match="already registered .one device.*override=True"):
        registry.register("single", "again")
    assert registry.register("single", "again", override=True).description == "again"
    with pytest.raises(ValueError, match="must be an identifier.*Received: name='my strategy'"):
        registry.register("my strategy", "spaces")
    with pytest.raises(ValueError, match=r"mesh.*\('data', 'data_model'\).*mesh='2d'"):
        registry.register("grid", "a grid", mesh="2d")
    with pytest.raises(TypeError, match="must be callable.*Received: 3 for jax='single'"):
        registry.builder("single", "jax")(3)
    with pytest.raises(ValueError, match="Received: strategy='singel'. Valid names: 'single', "):
        registry.builder("singel", "jax")


def test_build_names_what_is_missing(registry):
    plan = resolve("single", CPUS)
    with pytest.raises(ValueError, match="'single' has no builder for KERAS_BACKEND=jax.*none"):
        registry.build(plan, "jax")
    registry.builder("single", "tensorflow")(lambda plan, layout_map: "built")
    assert registry.build(plan, "tensorflow") == "built"
    with pytest.raises(ValueError, match=r"builds on: tensorflow.*builder\('single', 'jax'\)"):
        registry.build(plan, "jax")
    with pytest.raises(ValueError, match=r"\(data, model\) mesh \('pair'\). Received: strateg"):
        registry.build(plan, "tensorflow", layout_map=object())


@pytest.mark.torch
def test_a_built_in_name_without_a_builder_here_names_the_backends_it_builds_on(backend):
    # A process loads one backend, so the others' builders are not registered: the entry
    # still says where the name builds.
    assert STRATEGIES.entry("model_parallel").runs_on == ("jax", "torch")
    assert STRATEGIES.entry("fsdp").runs_on == ("jax", "torch")
    assert "torch" in STRATEGIES.entry("data_parallel").runs_on
    if backend != "tensorflow":
        pytest.skip("model_parallel builds on JAX and torch")
    with pytest.raises(ValueError, match=rf"'model_parallel'.*KERAS_BACKEND={backend}") as info:
        Accelerator(strategy="model_parallel")
    assert "JAX" in str(info.value) or "builds on: jax." in str(info.value)
    assert "none" not in str(info.value)


def test_built_in_names_stay():
    with pytest.raises(ValueError, match="'single' is built in"):
        STRATEGIES.unregister("single")
    with pytest.raises(ValueError, match="Received: strategy='nope'"):
        STRATEGIES.unregister("nope")


def test_a_registered_mesh_shape_and_platform_drive_the_plan():
    STRATEGIES.register("grid", "a (data, model) mesh", mesh="data_model")
    STRATEGIES.register("on_gpus", "GPUs only", platform="gpu")
    try:
        assert resolve("grid", CPUS, mesh_shape=(4, 2)).mesh_shape == (4, 2)
        with pytest.raises(RuntimeError, match="strategy='on_gpus' but no GPU was found"):
            resolve("on_gpus", CPUS)
    finally:
        STRATEGIES.unregister("grid")
        STRATEGIES.unregister("on_gpus")


def _native_data_parallel(plan, layout_map):
    """A user's builder: the backend's own data-parallel object over the plan's devices."""
    if keras.backend.backend() == "jax":
        return keras.distribution.DataParallel(devices=list(plan.devices))
    import tensorflow as tf

    names = [f"/device:CPU:{d.split(':')[1]}" for d in plan.devices]
    # Reduced through one device, not by collectives: two raw MirroredStrategies with
    # collectives over the same devices share TensorFlow's collective keys and abort each
    # other's all-reduces (tests/adapter/test_coexistence.py makes another one).
    return tf.distribute.MirroredStrategy(names, tf.distribute.ReductionToOneDevice())


def test_a_user_strategy_builds_and_trains_as_the_built_in_one(backend):
    built = []

    def build(plan, layout_map):
        built.append(plan)
        return _native_data_parallel(plan, layout_map)

    STRATEGIES.register("users_data_parallel", "a user's data parallelism", **{backend: build})
    try:
        x, y = data(37)
        runs = {}
        for name in ("users_data_parallel", "data_parallel"):
            acc = Accelerator(strategy=name, devices=FEW_REPLICAS, seed=0)
            with acc.scope():
                model = compiled_mlp()
            history = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
            runs[name] = (acc, history.history["loss"], weights_of(model))
        acc = runs["users_data_parallel"][0]
        assert [p.devices for p in built] == [tuple(f"cpu:{i}" for i in range(FEW_REPLICAS))]
        assert acc.strategy_name == "users_data_parallel"
        assert acc.distribution is not runs["data_parallel"][0].distribution
        assert acc.num_replicas == FEW_REPLICAS
        assert runs["users_data_parallel"][1] == pytest.approx(runs["data_parallel"][1], 1e-5)
        assert_weights_close(runs["users_data_parallel"][2], runs["data_parallel"][2])
    finally:
        STRATEGIES.unregister("users_data_parallel")


def test_a_users_builder_wins_over_the_backends_whenever_it_is_registered(registry):
    mine, theirs = (lambda plan, layout_map: "mine"), (lambda plan, layout_map: "theirs")
    registry.builder("single", "jax")(mine)
    registry.builder("single", "jax", default=True)(theirs)  # A backend loading later.
    plan = resolve("single", CPUS)
    assert registry.build(plan, "jax") == "mine"
    registry.builder("single", "tensorflow", default=True)(theirs)
    # An override replaces the builders it names and keeps the others.
    registry.register("single", "one device, mine", override=True, jax=theirs)
    assert registry.build(plan, "jax") == "theirs"
    assert registry.build(plan, "tensorflow") == "theirs"


def test_a_builder_that_does_not_span_the_plan_is_refused(backend):
    def first_two(plan, layout_map):
        return _native_data_parallel(dataclasses.replace(plan, devices=plan.devices[:2]), None)

    STRATEGIES.register("first_two", "the first two devices only", **{backend: first_two})
    try:
        with pytest.raises(ValueError, match=r"made a .* with 2 replica\(s\) over 2 device\(s\), "
                           r"but the plan has 4 replica\(s\) over 4 device"):  # fmt: skip
            Accelerator(strategy="first_two", devices=4)
    finally:
        STRATEGIES.unregister("first_two")


def test_tensorflow_cpu_replicas_sum_through_one_device_and_gpus_keep_the_default(
    backend, num_devices
):
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("tf.distribute's MirroredStrategy over several devices")
    import tensorflow as tf

    from keras_accel.adapter.backends.tensorflow.strategies import cross_device_ops

    assert isinstance(cross_device_ops(("cpu:0", "cpu:1")), tf.distribute.ReductionToOneDevice)
    assert cross_device_ops(("gpu:0", "gpu:1")) is None  # TensorFlow's choice: NCCL there
    # What an all-reduce of the Accelerator's strategy compiles to: AddN through one device,
    # no collective op (each costs a rendezvous of the replicas' collective executors: 12
    # times the AddN on CPUs, benchmarks/tf_all_reduce.py).
    strategy = Accelerator(devices=FEW_REPLICAS).distribution

    @tf.function
    def summed():
        def replica():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("SUM", [tf.ones((3,)) * 2.0])[0]

        return strategy.run(replica)

    for value in strategy.experimental_local_results(summed()):
        np.testing.assert_array_equal(value.numpy(), [2.0 * FEW_REPLICAS] * 3)
    graph = summed.get_concrete_function().graph.as_graph_def()
    ops = {node.op for node in graph.node}
    ops |= {node.op for function in graph.library.function for node in function.node_def}
    assert "AddN" in ops and not any(op.startswith("Collective") for op in ops), sorted(ops)


def test_tensorflow_device_data_sets_run_without_autotuning_threads(
    backend, num_devices, monkeypatch
):
    """Each device's data set that TensorFlow builds for an iterator of the Accelerator's
    distributed data runs without tf.data's autotuning thread (whose deletion waits out its
    tuning period: seconds to a minute per epoch, `runtime.Distributed`), the user's
    pipeline keeps its options, and TensorFlow's own function is back afterwards."""
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("tf.distribute's MirroredStrategy over several devices")
    import tensorflow as tf
    from tensorflow.python.data.ops import multi_device_iterator_ops

    original = multi_device_iterator_ops._create_device_dataset
    acc = Accelerator(devices=FEW_REPLICAS)
    rows = np.arange(8 * FEW_REPLICAS, dtype="float32").reshape(-1, 2)
    pipeline = tf.data.Dataset.from_tensor_slices(rows).batch(2 * FEW_REPLICAS)
    iterated = []
    dataset_iter = tf.data.Dataset.__iter__

    def spy(dataset):
        iterated.append(dataset.options().autotune.enabled)
        return dataset_iter(dataset)

    monkeypatch.setattr(tf.data.Dataset, "__iter__", spy)
    ours = iter(acc._runtime.distribute(pipeline, 2 * FEW_REPLICAS))
    assert iterated.count(False) == FEW_REPLICAS, iterated  # One per device.
    assert multi_device_iterator_ops._create_device_dataset is original
    first = [t.numpy() for t in acc.distribution.experimental_local_results(next(ours))]
    np.testing.assert_array_equal(np.concatenate(first), rows[: 2 * FEW_REPLICAS])

    iterated.clear()  # A distributed data set of the user's own: TensorFlow's defaults.
    iter(acc.distribution.distribute_datasets_from_function(lambda context: pipeline))
    assert False not in iterated and iterated, iterated


@pytest.mark.parametrize("kind", ["PyDataset", "generator"])
def test_tensorflow_pydatasets_and_generators_reach_the_devices_without_autotuning_threads(
    backend, num_devices, monkeypatch, kind
):
    """A `PyDataset` or a generator takes Keras's own route (its adapter, its tf.data
    pipeline), distributed as Keras distributes it but through `runtime.Distributed`: each
    epoch's per-device data sets run without an autotuning thread (an idle wait of seconds
    to a minute at every epoch boundary otherwise), and the fit equals plain Keras's."""
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("TensorFlow's per-device data sets: MirroredStrategy over several devices")
    import tensorflow as tf

    acc = Accelerator(devices=FEW_REPLICAS, steps_per_execution=1)
    x, y = data(24)
    with acc.scope():
        model = compiled_mlp(batchnorm=False)
    twin = compiled_mlp(batchnorm=False)
    twin.set_weights(model.get_weights())
    iterated = []
    dataset_iter = tf.data.Dataset.__iter__

    def spy(dataset):
        iterated.append(dataset.options().autotune.enabled)
        return dataset_iter(dataset)

    def batches():
        for _ in range(2):  # Two epochs of 3 batches.
            yield from (Batches(x, y, 8)[i] for i in range(3))

    monkeypatch.setattr(tf.data.Dataset, "__iter__", spy)
    if kind == "PyDataset":
        got = acc.fit(model, Batches(x, y, 8), epochs=2, shuffle=False, verbose=0)
        # Keras asks for an iterator as each epoch begins and another as it ends (the next
        # epoch's, which it drops unread): only the one read is made (`Distributed`), one
        # per epoch, each with one data set per device.
        assert iterated == [False] * 2 * FEW_REPLICAS, iterated
    else:
        got = acc.fit(model, batches(), epochs=2, steps_per_epoch=3, verbose=0)
        # One iterator over the stream, kept across epochs under steps_per_epoch.
        assert iterated == [False] * FEW_REPLICAS, iterated
    monkeypatch.undo()
    want = twin.fit(Batches(x, y, 8), epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    assert_weights_close(model.get_weights(), twin.get_weights())
