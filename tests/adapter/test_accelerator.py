"""The Accelerator's facts, scope, batch-size arithmetic and bad-input errors, on this backend."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_accel import STRATEGIES, Accelerator
from tests.helpers import FEW_REPLICAS, compiled_mlp, data, mlp, weights_of


def test_auto_uses_every_virtual_device(num_devices, backend):
    acc = Accelerator()
    assert acc.backend == backend
    assert acc.strategy_name == "data_parallel"
    assert acc.devices == [f"cpu:{i}" for i in range(num_devices)]
    assert acc.num_replicas == num_devices
    assert (acc.num_processes, acc.process_index, acc.is_chief) == (1, 0, True)
    text = repr(acc)
    assert f"backend='{backend}'" in text and "strategy='data_parallel'" in text
    assert f"num_replicas={num_devices}" in text and "is_chief=True" in text


def test_distribution_object_is_the_backend_native_one(backend):
    acc = Accelerator(strategy="mirrored", devices=4)
    if backend == "jax":
        assert isinstance(acc.distribution, keras.distribution.DataParallel)
    else:
        import tensorflow as tf

        assert isinstance(acc.distribution, tf.distribute.MirroredStrategy)
        assert acc.distribution.num_replicas_in_sync == 4
    assert Accelerator(strategy="single").distribution is None


def test_batch_size_arithmetic():
    acc = Accelerator()
    assert acc.global_batch_size(16) == 16 * acc.num_replicas
    assert acc.per_replica_batch_size(64) == 64 // acc.num_replicas
    with pytest.raises(ValueError, match="global_batch=100 does not split evenly over 8"):
        acc.per_replica_batch_size(100)
    with pytest.raises(ValueError, match="per_replica=0"):
        acc.global_batch_size(0)


def test_unknown_strategy_and_bad_arguments():
    with pytest.raises(ValueError, match="Received: strategy='tpuu'") as info:
        Accelerator(strategy="tpuu")
    assert all(repr(name) in str(info.value) for name in STRATEGIES)
    with pytest.raises(ValueError, match="mixed_precision='int8'"):
        Accelerator(mixed_precision="int8")
    with pytest.raises(ValueError, match="remainder='wrap'"):
        Accelerator(remainder="wrap")
    with pytest.raises(ValueError, match=r"mesh_shape=\(3, 3\) needs 9 devices but 8"):
        Accelerator(strategy="model_parallel", mesh_shape=(3, 3))


def test_tpu_strategy_without_tpu_errors_quickly():
    with pytest.raises(RuntimeError, match="no TPU was found"):
        Accelerator(strategy="tpu")


def test_unreachable_tpu_address_is_a_bounded_wait(backend):
    if backend != "tensorflow":
        pytest.skip("the TPU address hint is read by TPUClusterResolver (TensorFlow only)")
    # In a child process: a connection attempt that timed out may leave TensorFlow's runtime
    # locked, which must not stall the rest of the suite.
    env = dict(os.environ, KERAS_ACCEL_TPU="grpc://127.0.0.1:9", KERAS_ACCEL_TPU_TIMEOUT="5")
    code = (
        "import time\n"
        "from keras_accel import Accelerator\n"
        "start = time.time()\n"
        "try:\n"
        "    Accelerator(strategy='tpu')\n"
        "except (TimeoutError, RuntimeError) as e:\n"
        "    print('ERROR', type(e).__name__, round(time.time() - start), e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert "ERROR" in result.stdout, result.stderr[-2000:]
    assert "127.0.0.1:9" in result.stdout
    seconds = int(result.stdout.split()[2])
    assert seconds < 60


def test_scope_sets_mixed_precision_only_inside():
    acc = Accelerator(devices=FEW_REPLICAS, mixed_precision="bfloat16")
    with acc.scope():
        model = mlp()
    assert model.layers[0].dtype_policy.name == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "float32"
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x, y = data(32)
    with acc.scope():
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    history = acc.fit(model, x, y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_seed_gives_identical_initial_weights():
    def build():
        acc = Accelerator(seed=123)
        with acc.scope():
            return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7)])

    first, second = weights_of(build()), weights_of(build())
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_model_built_outside_scope_is_refused_naming_it():
    acc = Accelerator()
    model = compiled_mlp()
    x, y = data(32)
    with pytest.raises(RuntimeError, match="built outside `acc.scope\\(\\)`") as info:
        acc.fit(model, x, y, batch_size=16, verbose=0)
    assert f"Build and compile Sequential {model.name!r} inside `with acc.scope():`" in str(
        info.value
    )


def test_a_compiled_metric_created_outside_scope_is_named_before_a_step():
    acc = Accelerator()
    wacc = keras.metrics.SparseCategoricalAccuracy("wacc")  # Out here, on one device.
    with acc.scope():
        model = mlp()
        model.compile("sgd", "sparse_categorical_crossentropy", weighted_metrics=[wacc])
    x, y = data(32)
    with pytest.raises(RuntimeError, match="metric 'wacc' given to compile\\(\\) was created"):
        acc.evaluate(model, x, y, batch_size=16, verbose=0)


@pytest.mark.torch
def test_single_device_trains_a_model_built_anywhere_as_one_built_inside():
    # One device (and torch: a whole copy in each process): the scope places nothing, so a
    # model built outside it is the same model, and trains to the same weights.
    acc = Accelerator(strategy="single", seed=0)
    outside = compiled_mlp(batchnorm=False)
    with acc.scope():
        inside = compiled_mlp(batchnorm=False)
    inside.set_weights(outside.get_weights())
    x, y = data(20)
    for model in (outside, inside):
        history = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        assert len(history.history["loss"]) == 2
    for a, b in zip(weights_of(outside), weights_of(inside)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.torch
@pytest.mark.parametrize("source", ["arrays", "list", "tf.data", "validation_data"])
def test_text_targets_are_named_before_the_model_builds(backend, source):
    acc = Accelerator(seed=0)
    with acc.scope():
        model = compiled_mlp()
    x, _ = data(24)
    labels = np.array(["cat", "dog", "eel"] * 8)
    if source == "arrays":
        call = lambda: acc.fit(model, x, labels, batch_size=8, verbose=0)  # noqa: E731
        received = "y of dtype <U3 (first values ['cat', 'dog', 'eel'])"
    elif source == "list":
        call = lambda: acc.evaluate(model, x, labels.tolist(), batch_size=8, verbose=0)  # noqa
        received = "y of dtype str (first values ['cat', 'dog', 'eel'])"
    elif source == "tf.data":
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices((x, labels)).batch(8)
        call = lambda: acc.fit(model, ds, verbose=0)  # noqa: E731
        received = "the first batch's y of dtype string (first values [b'cat', b'dog', b'eel'])"
    else:
        _, y = data(24)
        val = (x, labels)
        call = lambda: acc.fit(model, x, y, batch_size=8, validation_data=val, verbose=0)  # noqa
        received = "validation_data's y of dtype <U3"
    with pytest.raises(ValueError, match="The targets are text") as info:
        call()
    message = str(info.value)
    assert f"Received: {received}" in message
    assert "keras.layers.StringLookup(num_oov_indices=0)" in message
    # What the message advises trains.
    lookup = keras.layers.StringLookup(num_oov_indices=0)
    lookup.adapt(labels)
    y = keras.ops.convert_to_numpy(lookup(labels))
    assert sorted(set(y.tolist())) == [0, 1, 2]
    history = acc.fit(model, x, y, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])


@pytest.mark.torch
def test_describe_reads_every_backends_arrays(backend):
    acc = Accelerator(strategy="single")
    with acc.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(2, name="out", dtype="bfloat16")], name="net"
        )
        model.compile("adam", "mse")
    model.optimizer.build(model.trainable_variables)
    report = acc.describe(model)
    rows = {row.path: row for row in report}
    assert rows["net/out/kernel"].dtype == "bfloat16"
    assert rows["net/out/kernel"].bytes_per_device == 4 * 2 * 2
    assert report.bytes_per_device("model") == (8 + 2) * 2
    assert report.total_bytes("optimizer") > 0
    assert str(report).startswith("net under single on 1 device:")


def test_unsupported_backend_is_a_clear_error():
    env = dict(os.environ, KERAS_BACKEND="numpy")
    code = "from keras_accel import Accelerator\nAccelerator()"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "Received: KERAS_BACKEND='numpy'" in result.stderr
    assert "KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow" in result.stderr


def test_fit_with_gradient_accumulation_is_refused_before_a_step_on_tf_and_exact_on_jax(backend):
    acc = Accelerator(seed=0)
    with acc.scope():
        model = compiled_mlp(
            optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), batchnorm=False
        )
    twin = compiled_mlp(
        optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), batchnorm=False
    )
    twin.set_weights(model.get_weights())
    before = weights_of(model)
    x, y = data(96)  # 6 full batches of 16: accumulation pairs them, 3 updates an epoch.
    if backend == "tensorflow" and acc.num_replicas > 1:
        # Keras's TF optimizer merges the replicas inside a cond, which a replicated step
        # refuses: one clear error before the first step, nothing trained.
        with pytest.raises(NotImplementedError, match="accumulation does not run under"):
            acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0)
        for a, b in zip(weights_of(model), before):
            np.testing.assert_array_equal(a, b)
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 0
        return
    history = acc.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    after = weights_of(model)
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) > 1e-3  # It trained.
    for i, (a, b) in enumerate(zip(after, weights_of(twin))):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6, err_msg=f"weight {i}")
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    # Keras counts the applied updates: 3 an epoch, as on one device.
    iterations = [int(keras.ops.convert_to_numpy(m.optimizer.iterations)) for m in (model, twin)]
    assert iterations == [6, 6]
