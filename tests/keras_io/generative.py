"""keras-io `examples/generative/`: vae (TensorFlow only: `tf.GradientTape`). Published code,
shrunk."""

import keras
from keras import layers, ops

from tests.keras_io._port import Port, example, rng


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def train_step(self, data):
        import tensorflow as tf

        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


@example("generative/vae", backends=("tensorflow",))
def vae():
    r = rng("vae")
    latent_dim = 2
    encoder_inputs = keras.Input(shape=(8, 8, 1))  # 28 x 28 published
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)  # 32
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(x)  # 64 published
    x = layers.Flatten()(x)
    x = layers.Dense(8, activation="relu")(x)  # 16 published
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")
    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(2 * 2 * 4, activation="relu")(latent_inputs)  # 7 * 7 * 64 published
    x = layers.Reshape((2, 2, 4))(x)
    x = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    mnist_digits = r.random((37, 8, 8, 1)).astype("float32")
    model = VAE(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam())
    # epochs=30, batch_size=128 published.
    fit = dict(x=mnist_digits, epochs=2, batch_size=16)
    # The published VAE has no `call`: its predictions are its encoder's and decoder's
    # (`vae.encoder.predict`, `vae.decoder.predict`), plain functional models; training,
    # through its own train_step, is what this port checks.
    return Port(model, fit, None, None)
