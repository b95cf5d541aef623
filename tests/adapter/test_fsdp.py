"""strategy="fsdp": every variable split over the data axis on JAX, training as one device
does; a clear error on TensorFlow.

What is sharded is read from the arrays' own shardings (JAX's), not from our bookkeeping."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.adapter.sharding import fully_sharded_axes
from tests.helpers import assert_weights_close, data


def test_the_rule_takes_the_largest_free_dimension_the_axis_divides():
    assert fully_sharded_axes((6, 16), (None, None), "batch", 8) == (None, "batch")
    assert fully_sharded_axes((32, 16), (None, None), "batch", 8) == ("batch", None)
    assert fully_sharded_axes((16, 16), (None, None), "batch", 8) == ("batch", None)
    assert fully_sharded_axes((16, 32), (None, "model"), "batch", 8) == ("batch", "model")
    assert fully_sharded_axes((3, 3, 8, 4), (None,) * 4, "batch", 4) == (None, None, "batch", None)
    assert fully_sharded_axes((3,), (None,), "batch", 8) == (None,)  # Nothing divides.
    assert fully_sharded_axes((4,), (None,), "batch", 8) == (None,)  # Smaller than the axis.
    assert fully_sharded_axes((), (), "batch", 8) == ()
    assert fully_sharded_axes((16,), ("batch",), "batch", 8) == ("batch",)  # Already there.
    assert fully_sharded_axes((16,), (None,), "batch", 1) == (None,)  # One device.
    with pytest.raises(ValueError, match=r"one axis per dimension. Received: shape=\(2, 3\)"):
        fully_sharded_axes((2, 3), (None,), "batch", 8)


def _model(optimizer, batchnorm=False):
    init = keras.initializers.GlorotUniform(seed=0)
    layers = [keras.Input((6,)), keras.layers.Dense(32, kernel_initializer=init, name="wide")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(name="norm"))
    layers += [
        keras.layers.Activation("relu"),
        keras.layers.Dense(3, "softmax", kernel_initializer=init, name="classes"),
    ]
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["acc"])
    return model


def _spec(variable):
    return tuple(variable.value.sharding.spec)


def _shards(variable):
    return {tuple(s.data.shape) for s in variable.value.addressable_shards}


@pytest.mark.parametrize(
    "optimizer, batchnorm",
    [(lambda: keras.optimizers.SGD(0.1), True), (lambda: keras.optimizers.Adam(0.01), False)],
    ids=["sgd_batchnorm", "adam"],
)
def test_fsdp_shards_every_variable_and_trains_as_one_device(
    backend, num_devices, optimizer, batchnorm, capsys, tmp_path
):
    if backend != "jax":
        with pytest.raises(ValueError, match="strategy='fsdp' needs the JAX backend.*Received"):
            Accelerator(strategy="fsdp")
        return
    acc = Accelerator(strategy="fsdp", seed=0)
    assert acc.strategy_name == "fsdp"
    assert acc.num_replicas == num_devices and acc.mesh_shape == (num_devices, 1)
    with acc.scope():
        model = _model(optimizer(), batchnorm)
    twin = _model(optimizer(), batchnorm)  # One device, the same initial weights.
    twin.set_weights(model.get_weights())
    # 37 rows in batches of 16: uneven, the last batch padded over the data axis.
    x, y = data(37)
    history = acc.fit(model, x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    note = capsys.readouterr().out
    assert "fsdp keeps 1 weight(s) whole on every device" in note
    assert f"of the data axis ({num_devices}): sequential" in note and "classes/bias (3,)" in note
    want = twin.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["acc"], want.history["acc"], rtol=1e-6)
    assert_weights_close(model.get_weights(), twin.get_weights())
    assert_weights_close(
        [np.asarray(v) for v in model.optimizer.variables],
        [np.asarray(v) for v in twin.optimizer.variables],
    )
    wide = model.get_layer("wide")
    # (6, 32): 32 splits over the devices; 6 does not.
    assert _spec(wide.kernel) == (None, "batch")
    assert _shards(wide.kernel) == {(6, 32 // num_devices)}
    assert _spec(wide.bias) == ("batch",)
    # (32, 3): the 32 rows split; the 3-class bias stays whole.
    classes = model.get_layer("classes")
    assert _spec(classes.kernel)[0] == "batch" and _spec(classes.bias) in ((), (None,))
    # Every optimizer slot lies as its variable does (here: Adam's moments, SGD has none).
    for variable in model.trainable_variables:
        slots = [v for v in model.optimizer.variables if v.path.endswith(variable.name)]
        for slot in slots:
            assert slot.shape == variable.shape and _spec(slot) == _spec(variable)
    if batchnorm:
        norm = model.get_layer("norm")
        assert _spec(norm.moving_mean) == ("batch",) and _shards(norm.gamma) == {
            (32 // num_devices,)
        }
    evaluated = acc.evaluate(model, x, y, batch_size=16, verbose=0, return_dict=True)
    expected = twin.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert evaluated == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(
        acc.predict(model, x, batch_size=16, verbose=0), twin.predict(x, verbose=0), atol=1e-5
    )
    # Keras's own saving gathers the shards: the file loads into a one-device model.
    path = str(tmp_path / "fsdp.weights.h5")
    model.save_weights(path)
    loaded = _model(optimizer(), batchnorm)
    loaded.load_weights(path)
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_fsdp_on_a_data_model_mesh_keeps_the_layout_map_and_adds_the_data_axis(backend):
    if backend != "jax":
        pytest.skip(
            "a (data, model) mesh is keras.distribution's; TF's refusal of fsdp is tested above"
        )
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*wide/kernel"] = (None, "model")
    acc = Accelerator(strategy="fsdp", mesh_shape=(2, 4), layout_map=layout_map, seed=0)
    assert acc.num_replicas == 2
    with acc.scope():
        model = _model(keras.optimizers.Adam(0.01))
    twin = _model(keras.optimizers.Adam(0.01))
    twin.set_weights(model.get_weights())
    wide = model.get_layer("wide")
    # The map's model axis stays; the data axis (2) takes the 6 rows beside it.
    assert _spec(wide.kernel) == ("batch", "model") and _shards(wide.kernel) == {(3, 8)}
    assert _spec(wide.bias) == ("batch",)  # Not in the map: the data axis alone.
    x, y = data(37)
    history = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_the_custom_loop_under_fsdp_keeps_the_state_sharded_and_equals_one_device(backend):
    if backend != "jax":
        pytest.skip("fsdp is JAX's (the TF error is tested above)")
    x, y = data(37)
    runs = {}
    for strategy in ("fsdp", "single"):
        acc = Accelerator(strategy=strategy, seed=0)
        with acc.scope():
            model = _model(keras.optimizers.Adam(0.01))
            optimizer = keras.optimizers.Adam(0.01)
        if "start" in runs:  # The same initial weights for both.
            model.set_weights(runs["start"])
        else:
            runs["start"] = model.get_weights()
        loop = acc.loop(model, optimizer=optimizer, loss="sparse_categorical_crossentropy")
        for epoch in range(2):
            for batch in loop.batches(x, y, batch_size=16, shuffle=False, epoch=epoch):
                loop.train_step(batch)
        runs[strategy] = (model, optimizer, loop.evaluate(x, y, batch_size=16))
    model, optimizer, logs = runs["fsdp"]
    assert _spec(model.get_layer("wide").kernel) == (None, "batch")
    slots = [v for v in optimizer.variables if len(v.shape) == 2 and v.shape[1] == 32]
    assert slots and all(_spec(v) == (None, "batch") for v in slots)  # Adam's, still split.
    assert logs == pytest.approx(runs["single"][2], rel=1e-5)
    assert_weights_close(model.get_weights(), runs["single"][0].get_weights())


def test_fsdp_on_one_device_has_no_note_about_whole_weights(backend, capsys):
    """On one device nothing is split: no weight is "kept whole" in any sense worth a note
    (examples/gemma_lora.py on one device said 13 were)."""
    if backend != "jax":
        pytest.skip("fsdp is JAX's")
    acc = Accelerator(strategy="fsdp", devices=1, seed=0)
    with acc.scope():
        model = _model(keras.optimizers.SGD(0.1), False)
    x, y = data(8)
    acc.fit(model, x, y, batch_size=4, epochs=1, verbose=0)
    assert "fsdp keeps" not in capsys.readouterr().out
