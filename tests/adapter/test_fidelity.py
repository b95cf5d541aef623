"""Keras's own contracts, kept: what plain Keras accepts works, numbers equal plain Keras on one
device, and nothing the Accelerator installs outlives its call. Both backends; 8 replicas where
the numbers are the subject, 2 (`FEW_REPLICAS`) where what is kept or left behind is."""

import warnings
import weakref

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.schedules import WarmupCosine
from tests.helpers import (
    FEW_REPLICAS,
    assert_replicas_agree,
    assert_weights_close,
    collect_until,
    compiled_mlp,
    data,
    series_far_from_zero,
    timeseries_classifier,
)


class Logs(keras.callbacks.Callback):
    """The logs every batch and epoch reports, as plain numbers."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append({k: float(v) for k, v in (logs or {}).items()})

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({k: float(v) for k, v in (logs or {}).items()})


def _pair(acc, **kwargs):
    with acc.scope():
        model = compiled_mlp(**kwargs)
    twin = compiled_mlp(**kwargs)
    twin.set_weights(model.get_weights())
    return model, twin


def _assert_logs_equal(got: list[dict], want: list[dict]):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert set(a) == set(b)
        for key in b:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_reported_loss_and_metrics_of_a_padded_epoch_equal_keras():
    # 230 rows in batches of 64: the last batch has 38 real rows and 26 padding rows. The
    # loss that callbacks monitor (EarlyStopping, ReduceLROnPlateau), every weighted and
    # unweighted metric, per batch and per epoch, equal plain Keras's.
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(230)
    sw = np.linspace(0.2, 2.0, 230).astype("float32")
    got, want = Logs(), Logs()
    acc.fit(model, x, y, sample_weight=sw, batch_size=64, epochs=2, shuffle=False,
            verbose=0, callbacks=[got])  # fmt: skip
    twin.fit(x, y, sample_weight=sw, batch_size=64, epochs=2, shuffle=False, verbose=0,
             callbacks=[want])  # fmt: skip
    assert_weights_close(model.get_weights(), twin.get_weights())
    _assert_logs_equal(got.batches, want.batches)
    _assert_logs_equal(got.epochs, want.epochs)


def test_list_wrapped_single_input_and_column_sample_weights_like_keras():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, twin = _pair(acc)
    x, y = data(101)
    sw = np.linspace(0.5, 1.5, 101).astype("float32")[:, None]  # (N, 1), as Keras's guides
    history = acc.fit(model, [x], y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    want = twin.fit([x], y, sample_weight=sw, batch_size=16, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        acc.predict(model, [x], verbose=0), twin.predict([x], verbose=0), atol=1e-5
    )


def test_no_trace_left_behind(tmp_path):
    # A model trained through the Accelerator, then through plain Keras, ends exactly where
    # its twin ends, copied out (weights and optimizer state) before the plain phase.
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(80)
    sw = np.linspace(0.5, 2.0, 80).astype("float32")
    before = set(model.__dict__)
    layer_dicts = {id(layer): set(layer.__dict__) for layer in model._flatten_layers()}
    acc.fit(model, x[:77], y[:77], batch_size=16, shuffle=False, verbose=0)  # padded
    acc.evaluate(model, x[:77], y[:77], verbose=0)
    acc.predict(model, x[:77], verbose=0)
    # Only what plain Keras's own fit/evaluate/predict add (history, iterators, flags).
    reference = compiled_mlp()
    reference_before = set(reference.__dict__)
    reference.fit(x, y, batch_size=16, verbose=0)
    reference.evaluate(x, y, verbose=0)
    reference.predict(x, verbose=0)
    keras_adds = set(reference.__dict__) - reference_before
    assert set(model.__dict__) - before <= keras_adds, set(model.__dict__) - before - keras_adds
    for layer in model._flatten_layers(include_self=False):
        assert set(layer.__dict__) == layer_dicts[id(layer)], layer.name
        if isinstance(layer, keras.layers.BatchNormalization):
            assert "_moments" not in layer.__dict__
    assert model.train_function is None and model.predict_function is None
    for metric in model.metrics:
        assert "update_state" not in metric.__dict__ and "result" not in metric.__dict__
    path = str(tmp_path / "copy.keras")
    model.save(path)
    with acc.scope():
        twin = keras.saving.load_model(path)
    assert_weights_close(model.get_weights(), twin.get_weights(), atol=0)
    # The plain phase, under the same distribution, on data plain Keras can split.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # none of our warnings in plain Keras
        with acc.scope():
            model.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0)
            twin.fit(x, y, sample_weight=sw, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights(), atol=1e-6)
    with acc.scope():
        got = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        want = twin.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert got == pytest.approx(want)


@pytest.mark.torch
def test_a_model_the_user_drops_is_freed_once_two_others_have_run():
    # A compiled step closes over its model. The Accelerator keeps the steps of the two
    # models it ran last (calls on either trace nothing again; on torch nothing traces) and
    # drops an older one's: a model the user let go is then freed, its weights and traced
    # graphs with it, as after plain Keras. It kept every model it ever ran before.
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x, y = data(40)

    def fitted():
        with acc.scope():
            model = compiled_mlp(batchnorm=False)
        acc.fit(model, x, y, batch_size=16, verbose=0)
        return model

    first, second = fitted(), fitted()
    traced = len(acc.guard.traces)
    acc.fit(first, x, y, batch_size=16, verbose=0)
    acc.fit(second, x, y, batch_size=16, verbose=0)
    assert len(acc.guard.traces) == traced
    dropped = weakref.ref(first)
    del first
    third = fitted()
    collect_until(lambda: dropped() is None)
    assert dropped() is None
    traced = len(acc.guard.traces)
    acc.fit(third, x, y, batch_size=16, verbose=0)
    acc.fit(second, x, y, batch_size=16, verbose=0)
    assert len(acc.guard.traces) == traced  # The two kept: nothing traced again.


def test_a_tensorflow_step_over_replicas_registers_no_gradient_function(backend):
    # In a traced function TensorFlow's `ReplicaContext.all_reduce` registers a gradient
    # function in its global registry at each call, and that function holds the step's graphs
    # for the rest of the process. The sums nothing differentiates (the row count, metrics'
    # states, the gradients applied) are reduced without one: a new model's fit, evaluate and
    # predict leave the registry as they found it. (Synchronized BatchNormalization's sums are
    # differentiated: each of its traces registers one, as in plain Keras.)
    if backend != "tensorflow":
        pytest.skip("TensorFlow's gradient registry: the TensorFlow run has it")
    from tensorflow.python.framework import ops

    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x, y = data(40)
    registered = None
    for _ in range(2):  # The first one also registers TensorFlow's own, once a process.
        with acc.scope():
            model = compiled_mlp(batchnorm=False)
        acc.fit(model, x, y, batch_size=16, validation_data=(x, y), verbose=0)
        acc.evaluate(model, x, y, batch_size=16, verbose=0)
        acc.predict(model, x, batch_size=16, verbose=0)
        if registered is None:
            registered = len(ops.gradient_registry._registry)
    assert len(ops.gradient_registry._registry) == registered


@pytest.mark.parametrize("sync_batchnorm", [True, False])
def test_synchronized_batchnorm_keeps_keras_meaning(backend, sync_batchnorm):
    if backend != "tensorflow":
        pytest.skip("Keras takes BatchNormalization(synchronized=True) on TensorFlow only")
    # A layer built synchronized stays synchronized, whatever the Accelerator's default.
    acc = Accelerator(devices=FEW_REPLICAS, sync_batchnorm=sync_batchnorm)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, kernel_initializer=keras.initializers.GlorotUniform(0)),
                keras.layers.BatchNormalization(synchronized=True),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile("sgd", "sparse_categorical_crossentropy")
    twin = keras.models.clone_model(model)
    twin.compile("sgd", "sparse_categorical_crossentropy")
    twin.set_weights(model.get_weights())
    x, y = data(101)
    acc.fit(model, x, y, batch_size=16, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    layer = model.layers[1]
    assert layer.synchronized and "_moments" not in layer.__dict__


def test_batchnorm_with_renorm_counts_real_rows_only_and_agrees_over_replicas():
    # renorm=True: its corrections and renorm statistics come from the batch moments, which
    # are ours too (real rows, summed over replicas): a padded epoch over 2 replicas trains
    # as one device on the real rows alone (they were once Keras's own: padding rows in,
    # per replica on TF).
    def renorm_model():
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, kernel_initializer=keras.initializers.GlorotUniform(0)),
                keras.layers.BatchNormalization(renorm=True, renorm_momentum=0.5),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )

    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = renorm_model()
        model.compile("sgd", "sparse_categorical_crossentropy")
    twin = renorm_model()
    twin.compile("sgd", "sparse_categorical_crossentropy")
    twin.set_weights(model.get_weights())
    x, y = data(27)  # In batches of 8: the last has 3 real rows, padded to 8.
    acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    layer = model.layers[1]
    assert layer.renorm and "_moments" not in layer.__dict__
    assert {"renorm_mean", "renorm_stddev"} <= {v.name for v in layer.non_trainable_weights}
    assert_weights_close(model.get_weights(), twin.get_weights())
    assert_replicas_agree(model.weights, acc.num_replicas)


def test_batchnorm_moments_are_one_devices_on_data_far_from_zero():
    # keras-io's timeseries classifier (Conv1D -> BatchNormalization -> ReLU) on series of
    # mean 100 and spread 1, 45 rows in batches of 8 over 8 replicas (the last batch padded),
    # 2 epochs: weights and losses are one device's. Each batch's variance is the mean of
    # squared deviations from the global mean, as Keras's own moments compute it; taken as
    # E[x^2] - E[x]^2 from the replicas' sums it lost digits to rounding: losses 5e-5 to
    # 7e-5 off, weights up to 20 times this tolerance on TF, 12 on JAX (where only the
    # padded batches take our moments). What is left is sums rounded in another order, which
    # training on data this far from zero grows: 0.4 of the tolerance on TF, in the first
    # layer's moving mean (100 times its kernel's difference).
    acc = Accelerator()
    with acc.scope():
        model = timeseries_classifier()
    twin = timeseries_classifier()
    twin.set_weights(model.get_weights())
    x, y = series_far_from_zero()
    got = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for i, (a, b) in enumerate(zip(model.get_weights(), twin.get_weights())):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5, err_msg=f"weight {i}")
    np.testing.assert_allclose(got.history["loss"], want.history["loss"], rtol=1e-5)
    assert_replicas_agree(model.weights, acc.num_replicas)


def test_sync_batchnorm_false_keeps_each_replicas_statistics(backend):
    # sync_batchnorm=False: each replica's statistics over its own rows, as plain Keras
    # computes them on TF, and so the same training as plain model.fit under the same
    # strategy; on JAX the program sees the global batch, so it equals one device.
    acc = Accelerator(devices=FEW_REPLICAS, sync_batchnorm=False)
    if acc.num_replicas == 1:
        pytest.skip("one device: nothing to synchronize")
    x, y = data(96)
    with acc.scope():
        model, distributed = compiled_mlp(), compiled_mlp()
    one_device = compiled_mlp()
    distributed.set_weights(model.get_weights())
    one_device.set_weights(model.get_weights())
    acc.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with acc.scope():
        distributed.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    one_device.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    bn = next(i for i, layer in enumerate(model.layers) if "batch_normalization" in layer.name)
    moving_variance = model.layers[bn].moving_variance.path
    index = [v.path for v in model.weights].index(moving_variance)
    if backend == "tensorflow":
        assert_weights_close(model.get_weights(), distributed.get_weights(), atol=1e-5)
        # Not the global batch's statistics: a replica's 8 rows have another variance.
        ours, global_ = model.get_weights()[index], one_device.get_weights()[index]
        assert not np.allclose(ours, global_, atol=1e-4), (ours, global_)
    else:
        assert_weights_close(model.get_weights(), one_device.get_weights(), atol=1e-5)
    # The default synchronizes: one-device training (covered for 8 replicas elsewhere).
    with pytest.raises(TypeError, match="sync_batchnorm.*Received: sync_batchnorm='no'"):
        Accelerator(sync_batchnorm="no")


def test_model_compiled_again_outside_the_scope_is_refused_the_same_way():
    acc = Accelerator(devices=FEW_REPLICAS)
    if acc.num_replicas == 1:
        pytest.skip("one device: every model is in place")
    with acc.scope():
        model = compiled_mlp()
    model.compile("adam", "sparse_categorical_crossentropy")  # outside the scope
    x, y = data(32)
    with pytest.raises(RuntimeError, match=r"compiled outside `acc.scope\(\)`: its variable"):
        acc.fit(model, x, y, batch_size=16, verbose=0)
    with acc.scope():
        model.compile("adam", "sparse_categorical_crossentropy")
    acc.fit(model, x, y, batch_size=16, verbose=0)


def test_schedule_that_needs_the_training_length_gets_it_from_fit():
    acc = Accelerator(devices=FEW_REPLICAS)
    x, y = data(96)
    schedule = WarmupCosine(0.5, warmup_fraction=0.25)
    with acc.scope():
        model = compiled_mlp(optimizer=keras.optimizers.SGD(schedule), batchnorm=False)
    bound = schedule.with_total_steps(2 * 6, steps_per_epoch=6)
    twin = compiled_mlp(optimizer=keras.optimizers.SGD(bound), batchnorm=False)
    twin.set_weights(model.get_weights())
    acc.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    # The optimizer keeps the user's schedule: plain Keras asks for the length again.
    assert model.optimizer._learning_rate is schedule and schedule.needs_total_steps


def test_accelerator_call_inside_a_callback_of_another():
    acc = Accelerator(devices=FEW_REPLICAS)
    model, _ = _pair(acc)
    x, y = data(70)
    seen = []

    class Evaluate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(acc.evaluate(model, x[:37], y[:37], verbose=0, return_dict=True))

    acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Evaluate()])
    assert len(seen) == 2 and all(np.isfinite(r["loss"]) for r in seen)
    assert "train_step" not in model.__dict__


def test_our_callbacks_leave_nothing_on_the_model(tmp_path):
    from keras_accel.callbacks import BackupAndRestore, History, LearningRateScheduler

    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(70)
    acc.fit(model, x, y, batch_size=16, verbose=0)  # Keras's own attributes exist now.
    before = set(model.__dict__)
    callbacks = [
        History(path=str(tmp_path / "history.json")),
        BackupAndRestore(str(tmp_path / "backup"), save_freq=2),
        LearningRateScheduler(lambda step: 0.01, update_freq="step"),
    ]
    acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0, callbacks=callbacks)
    assert set(model.__dict__) == before, set(model.__dict__) ^ before


SCALE = 2.0**24  # A float16 loss scale that overflows the tests' MLP's gradients.


def test_float16_fit_scales_the_loss_and_every_replica_decides_alike():
    # Under mixed_float16 the optimizer is a LossScaleOptimizer; its overflow check sees
    # the replicas' summed gradients, so all skip (or apply) the same step. The initial
    # scale is one that overflows this model's float16 gradients.
    acc = Accelerator(seed=0, mixed_precision="float16")
    with acc.scope():
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=SCALE)
        model = compiled_mlp(optimizer=scaled, batchnorm=False)
    # 101 rows in batches of 16: the last batch's 5 real rows leave 5 of the 8 replicas
    # padding only, with zero gradients of their own.
    x, y = data(101)
    history = acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0)
    assert all(np.isfinite(history.history["loss"]))
    assert all(np.isfinite(w).all() for w in model.get_weights())
    optimizer = model.optimizer
    # Some of the 14 steps overflowed (from the initial scale) and were skipped ...
    assert 0 < int(np.asarray(optimizer.iterations)) < 14
    assert float(np.asarray(optimizer.dynamic_scale)) < SCALE
    # ... by every replica alike: each holds the same scale, counters and weights.
    assert_replicas_agree(optimizer.variables, acc.num_replicas, exact=True)
    assert_replicas_agree(model.weights, acc.num_replicas)
