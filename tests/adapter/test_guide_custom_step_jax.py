"""Keras's guide "Customizing what happens in fit() with JAX", run through acc.fit.

The model classes are the guide's (keras-io guides/custom_train_step_in_jax.py), unchanged;
only `model.fit(x, y)` becomes `acc.fit(model, x, y)`, with the model built in
`acc.scope()`. Each part is compared with the same model trained by plain Keras on one
device: same weights, same reported loss and metrics, with 8 replicas.
"""

import warnings

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip("the JAX guide's steps use jax.value_and_grad", allow_module_level=True)

import jax  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from tests.helpers import assert_weights_close  # noqa: E402

ROWS, BATCH = 200, 32  # 200 = 6 full batches of 32 and a partial one of 8.


class CustomModel(keras.Model):
    def compute_loss_and_updates(
        self,
        trainable_variables,
        non_trainable_variables,
        metrics_variables,
        x,
        y,
        sample_weight,
        training=False,
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = (
            self.stateless_compute_loss(
                trainable_variables,
                non_trainable_variables,
                metrics_variables,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=training,
            )
        )
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def train_step(self, state, data):
        (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables) = (
            state
        )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
            x,
            y,
            sample_weight,
            training=True,
        )
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        new_metrics_vars = []
        logs = {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars) : len(new_metrics_vars) + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, loss, sample_weight=sample_weight
                )
            else:
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, y, y_pred, sample_weight=sample_weight
                )
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            new_metrics_vars,
        )
        return logs, state


class LowLevelModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(
        self, trainable_variables, non_trainable_variables, x, y, sample_weight, training=False
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training
        )
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables) = (
            state
        )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, sample_weight, training=True
        )
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        loss_tracker_vars = metrics_variables[: len(self.loss_tracker.variables)]
        mae_metric_vars = metrics_variables[len(self.loss_tracker.variables) :]
        loss_tracker_vars = self.loss_tracker.stateless_update_state(
            loss_tracker_vars, loss, sample_weight=sample_weight
        )
        mae_metric_vars = self.mae_metric.stateless_update_state(
            mae_metric_vars, y, y_pred, sample_weight=sample_weight
        )
        logs = {}
        logs[self.loss_tracker.name] = self.loss_tracker.stateless_result(loss_tracker_vars)
        logs[self.mae_metric.name] = self.mae_metric.stateless_result(mae_metric_vars)
        new_metrics_vars = loss_tracker_vars + mae_metric_vars
        state = (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            new_metrics_vars,
        )
        return logs, state

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class EvalModel(keras.Model):
    def test_step(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        (trainable_variables, non_trainable_variables, metrics_variables) = state
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=False
        )
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = (
            self.stateless_compute_loss(
                trainable_variables,
                non_trainable_variables,
                metrics_variables,
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=False,
            )
        )
        new_metrics_vars = []
        logs = {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars) : len(new_metrics_vars) + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, loss, sample_weight=sample_weight
                )
            else:
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, y, y_pred, sample_weight=sample_weight
                )
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars
        state = (trainable_variables, non_trainable_variables, new_metrics_vars)
        return logs, state


def _functional(cls):
    inputs = keras.Input(shape=(32,))
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(0))
    return cls(inputs, dense(inputs))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((ROWS, 32)).astype("float32"), rng.random((ROWS, 1)).astype("float32")


def _pair(acc, cls, **compile_args):
    with acc.scope():
        model = _functional(cls)
        model.compile(**compile_args)
    twin = _functional(cls)
    twin.compile(**compile_args)
    twin.set_weights(model.get_weights())
    return model, twin


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [CustomModel, LowLevelModel], ids=["stateless", "own_loss"])
def test_custom_train_step_matches_one_device_with_8_replicas(cls):
    acc = Accelerator()
    compile_args = {"optimizer": "adam"}
    if cls is CustomModel:
        compile_args.update(loss="mse", metrics=["mae"])
    model, twin = _pair(acc, cls, **compile_args)
    x, y = _data()
    # The guide's steps read sample_weight and hand it on, so the last partial batch is
    # padded with weight 0 rather than dropped: every row trains, as in plain Keras. The
    # loss's `Mean` given per-row weights beside one loss value averages it unweighted, as
    # plain Keras (which passes no weights here) does; the mae sees no padding factor.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = acc.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    for name in ("loss", "mae"):
        _close(got.history[name], want.history[name])


def test_custom_test_step_evaluates_exactly_when_nothing_is_padded():
    acc = Accelerator()
    model, twin = _pair(acc, EvalModel, loss="mse", metrics=["mae"])
    x, y = _data()
    got = acc.evaluate(model, x, y, batch_size=40, verbose=0, return_dict=True)
    want = twin.evaluate(x, y, batch_size=40, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])


def test_custom_test_step_handing_weights_to_its_loss_mean_evaluates_exactly_when_padded():
    # The guide's step passes per-row weights to the `Mean` of one scalar loss, which Keras
    # cannot broadcast: there the loss counts once per batch, unweighted, as plain Keras
    # computes it without weights.
    acc = Accelerator()
    model, twin = _pair(acc, EvalModel, loss="mse", metrics=["mae"])
    x, y = _data()
    got = acc.evaluate(model, x, y, batch_size=BATCH, verbose=0, return_dict=True)
    want = twin.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])
