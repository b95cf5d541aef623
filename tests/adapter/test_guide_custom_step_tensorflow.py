"""Keras's guide "Customizing what happens in fit() with TensorFlow", run through acc.fit.

The model classes are the guide's (keras-io guides/custom_train_step_in_tensorflow.py),
unchanged; only `model.fit(x, y)` becomes `acc.fit(model, x, y)`, with the model built in
`acc.scope()`. Each part is compared with the same model trained by plain Keras on one
device: same weights, same reported loss and metrics, with 8 replicas.
"""

import keras
import numpy as np
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip("the TensorFlow guide's steps use tf.GradientTape", allow_module_level=True)

import tensorflow as tf  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from tests.helpers import FEW_REPLICAS, assert_weights_close  # noqa: E402

ROWS, BATCH = 200, 32  # 200 = 6 full batches of 32 and a partial one of 8.


class SimpleModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LowLevelModel(keras.Model):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class WeightedModel(keras.Model):
    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


class EvalModel(keras.Model):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * keras.random.uniform(tf.shape(labels), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        random_latent_vectors = keras.random.normal(
            shape=(batch_size, self.latent_dim), seed=self.seed_generator
        )
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


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


def _close(got, want, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("cls", [SimpleModel, LowLevelModel], ids=["compute_loss", "own_loss"])
def test_custom_train_step_matches_one_device_with_8_replicas(cls):
    acc = Accelerator()
    compile_args = {"optimizer": "adam"}
    if cls is SimpleModel:
        compile_args.update(loss="mse", metrics=["mae"])
    model, twin = _pair(acc, cls, **compile_args)
    x, y = _data()
    # The step unpacks (x, y): the last partial batch runs unpadded, whole in every replica
    # (with a note), not padded.
    with pytest.warns(UserWarning, match=r"overrides train_step .* \(8 of 200 rows\) runs unp"):
        got = acc.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    # The loss the step reports is the global batch's, not divided by the replica count.
    for name in ("loss", "mae"):
        _close(got.history[name], want.history[name])


def test_step_that_honours_sample_weight_gets_padding_weighted_out():
    acc = Accelerator()
    model, twin = _pair(acc, WeightedModel, optimizer="adam", loss="mse", metrics=["mae"])
    x, y = _data()
    sw = np.random.default_rng(1).random((ROWS, 1)).astype("float32")  # (N, 1), as the guide
    got = acc.fit(model, x, y, sample_weight=sw, batch_size=BATCH, shuffle=False, verbose=0)
    want = twin.fit(x, y, sample_weight=sw, batch_size=BATCH, shuffle=False, verbose=0)
    # Every row trained, the padded last batch exactly like Keras's 8-row one.
    assert_weights_close(model.get_weights(), twin.get_weights())
    _close(got.history["mae"], want.history["mae"])


def test_custom_test_step_evaluates_exactly_when_nothing_is_padded():
    acc = Accelerator()
    model, twin = _pair(acc, EvalModel, loss="mse", metrics=["mae"])
    x, y = _data()
    # 200 rows in batches of 40 (a multiple of 8): the step gets (x, y), as in Keras.
    got = acc.evaluate(model, x, y, batch_size=40, verbose=0, return_dict=True)
    want = twin.evaluate(x, y, batch_size=40, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])


def test_custom_test_step_that_cannot_take_padding_weights_evaluates_every_row():
    # The step unpacks (x, y): the last partial batch runs whole in every replica.
    acc = Accelerator()
    model, twin = _pair(acc, EvalModel, loss="mse", metrics=["mae"])
    x, y = _data()
    with pytest.warns(UserWarning, match=r"EvalModel overrides test_step .* runs unpadded"):
        got = acc.evaluate(model, x, y, batch_size=BATCH, verbose=0, return_dict=True)
    want = twin.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])


def test_custom_test_step_that_cannot_take_padding_weights_evaluates_a_stream_whole():
    # A data set's short batch is known only when it comes: its pipeline is read on the
    # host, and that batch runs whole in every replica (2: the subject is the split).
    acc = Accelerator(devices=FEW_REPLICAS)
    model, twin = _pair(acc, EvalModel, loss="mse", metrics=["mae"])
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.warns(UserWarning, match=r"EvalModel overrides test_step .* runs unpadded"):
        got = acc.evaluate(model, dataset, verbose=0, return_dict=True)
    want = twin.evaluate(dataset, verbose=0, return_dict=True)
    assert set(got) == set(want)
    for name in want:
        _close(got[name], want[name])


def test_gan_trains_on_images_without_targets():
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            keras.layers.Conv2D(8, (3, 3), strides=(2, 2), padding="same"),
            keras.layers.LeakyReLU(negative_slope=0.2),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )
    latent_dim = 4
    # 2 replicas: its stream's short batch runs whole in each, through a step traced for it
    # (8 replicas took 20 s more to trace it; the subject is the split, not the count).
    acc = Accelerator(devices=FEW_REPLICAS)
    with acc.scope():
        generator = keras.Sequential(
            [
                keras.Input(shape=(latent_dim,)),
                keras.layers.Dense(4 * 4 * 8),
                keras.layers.LeakyReLU(negative_slope=0.2),
                keras.layers.Reshape((4, 4, 8)),
                keras.layers.Conv2DTranspose(8, (4, 4), strides=(2, 2), padding="same"),
                keras.layers.Conv2D(1, (3, 3), padding="same", activation="sigmoid"),
            ],
            name="generator",
        )
        discriminator = keras.models.clone_model(discriminator)
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
        gan.compile(
            d_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
            g_optimizer=keras.optimizers.Adam(learning_rate=0.0003),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    images = np.random.default_rng(0).random((70, 8, 8, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(16)  # 4 x 16 and one of 6
    if acc.num_replicas > 1:
        # Under tf.distribute an optimizer must exist before the first step; Keras builds
        # `model.optimizer` only (raw MirroredStrategy fails on this guide the same way).
        with pytest.raises(ValueError, match=r"GAN.d_optimizer is not built"):
            acc.fit(gan, dataset, verbose=0)
        with acc.scope():
            gan.d_optimizer.build(gan.discriminator.trainable_variables)
            gan.g_optimizer.build(gan.generator.trainable_variables)
    before = [w.copy() for w in gan.generator.get_weights()]
    # A stream's partial batch is known only when it comes: the note cannot count its rows.
    # It runs unpadded (whole in every replica).
    unpadded = r"no targets .* a batch of a tf.data.Dataset .* not full .* runs unpadded"
    with pytest.warns(UserWarning, match=unpadded):
        history = acc.fit(gan, dataset, epochs=2, verbose=0)
    assert sorted(history.history) == ["d_loss", "g_loss"]
    assert all(np.isfinite(v) for values in history.history.values() for v in values)
    after = gan.generator.get_weights()
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
