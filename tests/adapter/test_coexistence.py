"""Raw tf.distribute strategies, keras.distribution settings and Accelerators in one process."""

import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import FEW_REPLICAS, compiled_mlp, data


def _fits(model, x, y, **kwargs):
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, **kwargs)
    return np.isfinite(history.history["loss"][0])


def test_raw_mirrored_strategy_and_accelerator_in_either_order(backend, num_devices):
    if backend != "tensorflow" or num_devices < 2:
        pytest.skip("MirroredStrategy over several devices")
    import tensorflow as tf

    x, y = data(128)
    devices = [f"/cpu:{i}" for i in range(FEW_REPLICAS)]
    # Two raw strategies would clash with each other (TensorFlow's own limit); one raw
    # strategy and the Accelerator's must not: raw, ours, raw again, ours again.
    raw = tf.distribute.MirroredStrategy(devices)
    with raw.scope():
        raw_model = compiled_mlp()  # BatchNormalization: collectives on every step
    assert _fits(raw_model, x, y)
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        ours = compiled_mlp()
    assert np.isfinite(acc.fit(ours, x, y, batch_size=64, verbose=0).history["loss"][0])
    with raw.scope():
        assert _fits(raw_model, x, y)
    assert np.isfinite(acc.fit(ours, x[:100], y[:100], batch_size=64, verbose=0).history["loss"][0])


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

    from tests.helpers import assert_weights_close, weights_of

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
