"""Raw tf.distribute strategies, keras.distribution settings and Accelerators in one process."""

import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import FEW_REPLICAS, assert_weights_close, compiled_mlp, data, weights_of


def _fits(model, x, y, **kwargs):
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, **kwargs)
    return np.isfinite(history.history["loss"][0])


def _loss(history):
    return history.history["loss"][0]


def _fit(model, x, y):
    """One epoch of plain model.fit, unshuffled: its loss."""
    return _loss(model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0))


def test_raw_mirrored_strategy_and_accelerator_in_either_order(backend, num_devices):
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("MirroredStrategy over several devices")
    import tensorflow as tf

    x, y = data(128)
    devices = [f"/cpu:{i}" for i in range(FEW_REPLICAS)]
    # Two raw strategies would clash with each other (TensorFlow's own limit); one raw
    # strategy and the Accelerator's must not: raw, ours, raw again, ours again, each with
    # the numbers it has alone.
    raw = tf.distribute.MirroredStrategy(devices)
    with raw.scope():
        raw_model = compiled_mlp()  # BatchNormalization: collectives on every step
        raw_alone = compiled_mlp()
    raw_alone.set_weights(raw_model.get_weights())
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        ours = compiled_mlp()
    twin = compiled_mlp()  # one device, ours's initial weights
    twin.set_weights(ours.get_weights())

    # What each does alone: the raw fits before the Accelerator trains, one device's.
    with raw.scope():
        raw_want = [_fit(raw_alone, x, y), _fit(raw_alone, x, y)]
    want = [_fit(twin, x, y), _fit(twin, x[:100], y[:100])]  # 64 + 36 rows, padded

    raw_got = [_fit(raw_model, x, y)]
    got = [_loss(acc.fit(ours, x, y, batch_size=64, shuffle=False, verbose=0))]
    with raw.scope():
        raw_got.append(_fit(raw_model, x, y))
    got.append(_loss(acc.fit(ours, x[:100], y[:100], batch_size=64, shuffle=False, verbose=0)))

    np.testing.assert_allclose(raw_got, raw_want, rtol=1e-5)
    assert_weights_close(weights_of(raw_model), weights_of(raw_alone))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_weights_close(weights_of(ours), weights_of(twin))
    assert raw_want[1] < raw_want[0] and want[1] != want[0]  # they trained


def test_global_keras_distribution_is_left_as_the_user_set_it(backend, num_devices):
    if backend != "jax" or num_devices < 2:
        pytest.skip("keras.distribution over several JAX devices")
    from keras import distribution

    users = distribution.DataParallel(devices=distribution.list_devices()[:2])
    distribution.set_distribution(users)
    try:
        plain = compiled_mlp()  # laid out by the user's global distribution
        x, y = data(128)
        acc = Accelerator(devices=FEW_REPLICAS)
        with acc.scope():
            ours = compiled_mlp()
        acc.fit(ours, x[:101], y[:101], batch_size=16, verbose=0)
        assert distribution.distribution() is users
        assert _fits(plain, x, y)
    finally:
        distribution.set_distribution(None)


def test_accelerator_inside_a_raw_strategy_scope_is_one_clear_error(backend, num_devices):
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("tf.distribute strategies over several devices")
    import keras
    import tensorflow as tf

    x, y = data(64)
    # Only its scope is entered: a second raw strategy in this process, over other devices
    # than the one the test above ran collectives on, would share its collective keys (raw
    # strategies all number them from the same start) and abort the process's collectives.
    raw = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    acc = Accelerator(devices=2, seed=0)
    with acc.scope():
        ours = compiled_mlp(batchnorm=False)
    twin = compiled_mlp(batchnorm=False)
    twin.set_weights(ours.get_weights())
    before = weights_of(ours)
    built = []
    with raw.scope():
        with pytest.raises(RuntimeError, match="cannot nest two strategies") as info, acc.scope():
            built.append(compiled_mlp())
        assert "MirroredStrategy" in str(info.value)
        with pytest.raises(RuntimeError, match="cannot nest two strategies"):
            acc.fit(ours, x, y, batch_size=16, verbose=0)
    assert built == [] and not tf.distribute.has_strategy()
    for a, b in zip(weights_of(ours), before):
        np.testing.assert_array_equal(a, b)
    # Outside the user's scope ours trains as one device does.
    history = acc.fit(ours, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(weights_of(ours), weights_of(twin), atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    assert int(keras.ops.convert_to_numpy(ours.optimizer.iterations)) == 4
