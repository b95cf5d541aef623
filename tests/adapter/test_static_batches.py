"""Uneven data under 8 replicas: no crash, no recompilation, exact results, same updates."""

import warnings

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import assert_weights_close, compiled_mlp, data, per_replica_values


def _pair(acc, **kwargs):
    """A model in the Accelerator's scope, and a single-device twin with the same weights."""
    with acc.scope():
        model = compiled_mlp(**kwargs)
    twin = compiled_mlp(**kwargs)
    twin.set_weights(model.get_weights())
    return model, twin


def test_raw_keras_fails_on_the_partial_batch(backend, num_devices):
    # The bug keras_accel exists for (keras#21167 on JAX, keras#19246 on TF). If Keras ever
    # fixes it, this test says so.
    acc = Accelerator()
    with acc.scope():
        model = compiled_mlp()
    x, y = data(101)
    if backend == "jax":
        keras.distribution.set_distribution(acc.distribution)
        # jax's IndivisibleError (a ValueError): 101 rows do not split over the batch axis.
        error = ValueError
        match = rf"partitioned {num_devices} times, but the dimension size is 101"
    else:
        import tensorflow as tf

        # AddN over the replicas' outputs, whose rows differ (13 x 7 + 10 on 8 replicas).
        rows = -(-101 // num_devices)
        last = 101 - rows * (num_devices - 1)
        error = tf.errors.InvalidArgumentError
        match = (
            r"AddN must have the same size and shape.* "
            rf"\[{rows},6\] != input {num_devices - 1}: \[{last},6\]"
        )
    with pytest.raises(error, match=match), acc.scope():
        model.evaluate(x, y, batch_size=101, verbose=0)


def test_fit_evaluate_predict_on_uneven_data_without_recompiling():
    acc = Accelerator(seed=0)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(101)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a recompile warning fails the test
        history = acc.fit(
            model, x, y, batch_size=16, epochs=3, verbose=0, validation_data=(x[:37], y[:37])
        )
        for _ in range(2):
            acc.evaluate(model, x, y, batch_size=16, verbose=0)
            predictions = acc.predict(model, x, batch_size=16, verbose=0)
    assert len(history.history["loss"]) == 3 and "val_loss" in history.history
    assert predictions.shape == (101, 3)
    kinds = sorted(trace.kind for trace in acc.guard.traces)
    assert kinds == ["predict", "test", "train"], acc.guard.traces
    assert acc.num_recompiles == 0


def test_guard_reports_a_new_shape_after_warmup():
    acc = Accelerator(strategy="single")
    model = compiled_mlp()
    x, y = data(40)
    acc.predict(model, x, batch_size=16, verbose=0)
    # TF relaxes a retraced batch axis to None; JAX traces the new shape. The step gets
    # `x` itself, as Keras packs one array (not `(x,)`).
    warning = r"`predict_step` was traced again .*for input shapes \((8|None), 6\) and"
    with pytest.warns(RuntimeWarning, match=warning):
        acc.predict(model, x, batch_size=8, verbose=0)
    assert acc.num_recompiles == 1
    assert acc.guard.traces[-1].shapes in ((8, 6), (None, 6))
    # A plain Keras call runs none of our code: nothing is recorded, nothing warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model.predict(x[:5], batch_size=5, verbose=0)
    assert acc.num_recompiles == 1


def test_evaluate_equals_unpadded_single_device_result():
    acc = Accelerator()
    model, twin = _pair(acc, regularize=True)
    x, y = data(101)
    sample_weight = np.linspace(0.5, 2.0, 101).astype("float32")
    got = acc.evaluate(
        model, x, y, batch_size=16, sample_weight=sample_weight, verbose=0, return_dict=True
    )
    want = twin.evaluate(
        x, y, batch_size=101, sample_weight=sample_weight, verbose=0, return_dict=True
    )
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_predict_returns_every_row_in_order():
    acc = Accelerator()
    model, twin = _pair(acc)
    x, _ = data(101)
    got = acc.predict(model, x, batch_size=24, verbose=0)
    np.testing.assert_allclose(got, np.asarray(twin(x, training=False)), atol=1e-6)


def test_padded_batch_update_equals_real_rows_alone():
    # One step on 11 real rows padded to 16 over 8 replicas, BatchNorm included, must equal
    # plain Keras training on those 11 rows on one device.
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(11)
    acc.fit(model, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=11, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_multi_batch_epoch_matches_single_device_keras():
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(27)
    acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_indivisible_batch_size_is_padded_with_a_warning_and_stays_exact():
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(30)
    with pytest.warns(
        UserWarning, match="batch_size=10 does not split over 8 replicas.*16 rows"
    ) as caught:
        acc.fit(model, x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert {w.filename for w in caught} == {__file__}  # The user's line, not ours.
    twin.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_batchnorm_statistics_are_identical_on_every_replica():
    acc = Accelerator()
    with acc.scope():
        model = compiled_mlp()
    x, y = data(96, seed=1)
    acc.fit(model, x * np.linspace(0.1, 3, 96)[:, None], y, batch_size=32, epochs=2, verbose=0)
    bn = next(layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization))
    for variable in (bn.moving_mean, bn.moving_variance):
        copies = per_replica_values(variable)
        assert len(copies) in (1, acc.num_replicas)
        for copy in copies[1:]:
            np.testing.assert_allclose(copy, copies[0], rtol=1e-6, atol=1e-7)


def test_drop_remainder_skips_the_partial_batch_and_reshuffles():
    acc = Accelerator(remainder="drop", seed=1)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(100)
    counter = _BatchCounter()
    acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0, callbacks=[counter])
    assert counter.batches == [6, 6]


def _one(y_true, y_pred):
    # A metric function returning a Python float, as in Keras's trainer tests.
    return 1.0


def _compiled_with_metric_functions(**kwargs):
    model = compiled_mlp(**kwargs)
    model.compile(
        optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy", _one]
    )
    return model


def test_batch_size_below_replica_count_is_padded_and_matches_one_device_keras():
    # A global batch smaller than the replica count (Keras's trainer tests use 1 to 5):
    # padded to one row per replica, weighted 0, with a note; losses, metrics,
    # BatchNormalization statistics and weights are one device's.
    acc = Accelerator()
    with acc.scope():
        model = _compiled_with_metric_functions()
    twin = _compiled_with_metric_functions()
    twin.set_weights(model.get_weights())
    x, y = data(7)
    with pytest.warns(UserWarning, match="batch_size=3 is smaller than the 8 replicas") as caught:
        history = acc.fit(model, x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    assert {w.filename for w in caught} == {__file__}
    expected = twin.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())  # BN statistics included.
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # The note is said once per process.
        logs = acc.evaluate(model, x, y, batch_size=3, verbose=0, return_dict=True)
        predictions = acc.predict(model, x, batch_size=3, verbose=0)
    for name, value in twin.evaluate(x, y, batch_size=3, verbose=0, return_dict=True).items():
        np.testing.assert_allclose(logs[name], value, rtol=1e-5, err_msg=name)
    assert logs["_one"] == 1.0
    np.testing.assert_allclose(predictions, twin.predict(x, batch_size=3, verbose=0), atol=1e-6)


def test_length_mismatch_is_refused_before_training():
    acc = Accelerator()
    with acc.scope():
        model = compiled_mlp()
    x, y = data(20)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"x: \[20\], y: \[19\]"):
        acc.fit(model, x, y[:19], batch_size=8, verbose=0)
    assert_weights_close(model.get_weights(), before, atol=0)


class _BatchCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.batches[-1] += 1


def test_shuffle_order_is_a_function_of_the_epoch_so_resuming_is_exact():
    # Two epochs in one call, or one epoch then a second call from initial_epoch=1: the same
    # rows in the same order, hence the same weights.
    x, y = data(45)
    runs = []
    for split in (False, True):
        acc = Accelerator(seed=7)
        with acc.scope():
            model = compiled_mlp()
        if split:
            acc.fit(model, x, y, batch_size=16, epochs=1, verbose=0)
            acc.fit(model, x, y, batch_size=16, epochs=2, initial_epoch=1, verbose=0)
        else:
            acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0)
        runs.append(model.get_weights())
    assert_weights_close(runs[0], runs[1], atol=1e-6)


def test_saved_weights_are_the_weights_that_were_used(tmp_path):
    # After distributed training with BatchNorm, the weights file (first replica's copy on TF)
    # and the whole-model file (the second seed's HDF5 failure) load into a single-device
    # model with plain Keras and reproduce the Accelerator's predictions.
    acc = Accelerator(seed=3)
    model, twin = _pair(acc)
    x, y = data(77, seed=2)
    acc.fit(model, x * 3.0, y, batch_size=16, epochs=2, verbose=0)
    expected = acc.predict(model, x, verbose=0)
    path = str(tmp_path / "trained.weights.h5")
    model.save_weights(path)
    twin.load_weights(path)
    np.testing.assert_allclose(expected, np.asarray(twin(x, training=False)), atol=1e-5)
    whole = str(tmp_path / "trained.keras")
    model.save(whole)
    loaded = keras.saving.load_model(whole)  # Outside any scope: one device.
    np.testing.assert_allclose(expected, np.asarray(loaded(x, training=False)), atol=1e-5)
    assert loaded.optimizer.iterations.numpy() == model.optimizer.iterations.numpy()


def test_guard_warm_up_is_per_model():
    acc = Accelerator(strategy="single")
    first, second = compiled_mlp(), compiled_mlp()
    x, _ = data(40)
    acc.predict(first, x, batch_size=16, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        acc.predict(second, x, batch_size=16, verbose=0)  # its own first trace: warm-up
    assert acc.num_recompiles == 0
