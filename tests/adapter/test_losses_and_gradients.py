"""Losses and gradients across replicas, owned by the call: no Keras, TensorFlow or JAX class
or module changes while a call runs; the optimizer clips the global batch's gradient; a
custom step's own averaged loss keeps Keras's convention on TensorFlow (docs/accelerator.md,
"Custom steps")."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from tests.helpers import (
    FEW_REPLICAS,
    assert_weights_close,
    changed_library_state,
    compiled_mlp,
    data,
    library_state,
)


class _Snapshot(keras.callbacks.Callback):
    """Reads `library_state()` at the end of every epoch, evaluation and prediction: inside
    the Accelerator's call, after its steps ran."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_epoch_end(self, epoch, logs=None):
        self.states.append(library_state())

    def on_test_end(self, logs=None):
        self.states.append(library_state())

    def on_predict_end(self, logs=None):
        self.states.append(library_state())


class HoldsItsLoss(keras.Sequential):
    """A custom step as Keras's guides write them: a loss object it holds, and compute_loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.tracker = keras.metrics.Mean(name="own")

    def train_step(self, data):
        x, y = data[:2]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred) + self.loss_fn(y, y_pred)
        self.optimizer.apply(
            tape.gradient(loss, self.trainable_variables), self.trainable_variables
        )
        self.tracker.update_state(loss)
        return {"own": self.tracker.result()}


def test_no_library_class_or_module_changes_during_any_call(backend):
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x, y = data(70)  # Batches of 16: the last one is padded.
    with acc.scope():
        model = compiled_mlp()
        # The TF guide's custom step (JAX's steps are stateless functions of their own).
        custom = (HoldsItsLoss if backend == "tensorflow" else keras.Sequential)(
            compiled_mlp().layers
        )
        custom.compile("sgd", "sparse_categorical_crossentropy")
    acc.fit(model, x, y, batch_size=16, verbose=0)  # Keras imports and caches what it uses.
    acc.fit(custom, x[:64], y[:64], batch_size=16, verbose=0)
    before = library_state()
    snapshot = _Snapshot()
    acc.fit(
        model, x, y, batch_size=16, epochs=1, verbose=0, validation_split=0.2, callbacks=[snapshot]
    )
    acc.evaluate(model, x, y, batch_size=16, verbose=0, callbacks=[snapshot])
    acc.predict(model, x, batch_size=16, verbose=0, callbacks=[snapshot])
    acc.fit(custom, x[:64], y[:64], batch_size=16, verbose=0, callbacks=[snapshot])
    loop = acc.loop(model)
    for batch in loop.batches(x, y, batch_size=16):
        loop.train_step(batch)
    snapshot.states.append(library_state())
    assert len(snapshot.states) == 6
    for state in snapshot.states:
        assert changed_library_state(before, state) == []


def _clipped_pair(acc, **clipping):
    def make():
        return compiled_mlp(optimizer=keras.optimizers.SGD(0.5, **clipping), batchnorm=False)

    with acc.scope():
        model = make()
    twin = make()
    twin.set_weights(model.get_weights())
    return model, twin


@pytest.mark.parametrize(
    "clipping",
    [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.002}],
    ids=["clipnorm", "global_clipnorm", "clipvalue"],
)
def test_the_optimizer_clips_the_global_batch_s_gradient(clipping):
    # Keras on TF clips each replica's share before summing the shares; here the sum is
    # clipped, as one device clips its gradient.
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    model, twin = _clipped_pair(acc, **clipping)
    x, y = data(70)
    acc.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())


class AveragesItself(keras.Sequential):
    """A custom step that averages a loss function's values itself (not a Keras loss object)."""

    def train_step(self, data):
        x, y = data[:2]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = ops.mean(keras.losses.sparse_categorical_crossentropy(y, y_pred))
        self.optimizer.apply(
            tape.gradient(loss, self.trainable_variables), self.trainable_variables
        )
        return {"loss": loss}


def test_a_custom_step_s_own_average_keeps_keras_s_convention_on_tensorflow(backend):
    """On TF, Keras divides the losses it computes by the replica count and sums the
    replicas' gradients; a loss the step averages itself is not divided, and its gradient
    counts once per replica, as with raw MirroredStrategy: N replicas train it as one device
    with N times the learning rate. (Compared with one device, not with a raw
    MirroredStrategy: two strategies over the same devices clash in TF's collectives, which
    then abort every later one in the process.)"""
    if backend != "tensorflow":
        pytest.skip("the convention is TF's: on JAX one program computes the global loss")
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x, y = data(64)  # 4 batches of 16: nothing padded (the step takes no weights).

    def make(rate):
        model = AveragesItself(compiled_mlp(batchnorm=False).layers)
        model.compile(keras.optimizers.SGD(rate))
        return model

    with acc.scope():
        ours = make(0.05)
    one_device = make(0.05 * acc.num_replicas)
    one_device.set_weights(ours.get_weights())
    acc.fit(ours, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    one_device.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(ours.get_weights(), one_device.get_weights())


class UpdatesAMetricInComputeLoss(keras.Model):
    """Keras's trainer test `test_metric_update_in_compute_loss`: a class's own compute_loss
    that calls Keras's and updates a metric with the loss."""

    def __init__(self):
        super().__init__()
        self.custom_metric = keras.metrics.Mean(name="custom")
        self.dense = keras.layers.Dense(2, kernel_initializer="ones", activity_regularizer="l2")

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom_metric.update_state(loss * 4)
        return loss


def test_a_metric_updated_in_compute_loss_and_jit_compile_give_one_device_s_numbers():
    # On TF Keras's compute_loss returns each replica's share of the loss (divided by the
    # replica count): the metric reported 1/N of one device's. jit_compile=True (XLA) fails
    # under a MirroredStrategy over CPU devices; the call runs without it, with a note.
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x = np.ones((32, 4), "float32") * np.linspace(0.5, 1.5, 32)[:, None].astype("float32")
    y = np.ones((32, 2), "float32") * 2

    def make():
        model = UpdatesAMetricInComputeLoss()
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        return model

    with acc.scope():
        ours = make()
    one_device = make()
    history = acc.fit(ours, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = one_device.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert ours.jit_compile  # The model keeps what it was compiled with.
    assert_weights_close(ours.get_weights(), one_device.get_weights())
    for name in ("loss", "custom"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    logs = acc.evaluate(ours, x, y, batch_size=16, verbose=0, return_dict=True)
    assert logs == pytest.approx(
        one_device.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    )
