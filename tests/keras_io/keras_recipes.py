"""keras-io `examples/keras_recipes/`: antirectifier, endpoint_layer_pattern, trainer_pattern
(TensorFlow only: `tf.GradientTape`), memory_efficient_embeddings (TensorFlow only: string
lookups, `tf.lookup`). Published code, shrunk."""

import keras
import numpy as np
from keras import layers, ops

from tests.keras_io._port import Port, example, rng


class Antirectifier(layers.Layer):
    def __init__(self, initializer="he_normal", **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        output_dim = input_shape[-1]
        self.kernel = self.add_weight(
            shape=(output_dim * 2, output_dim),
            initializer=self.initializer,
            name="kernel",
            trainable=True,
        )

    def call(self, inputs):
        inputs -= ops.mean(inputs, axis=-1, keepdims=True)
        pos = ops.relu(inputs)
        neg = ops.relu(-inputs)
        concatenated = ops.concatenate([pos, neg], axis=-1)
        mixed = ops.matmul(concatenated, self.kernel)
        return mixed

    def get_config(self):
        base_config = super().get_config()
        config = {"initializer": keras.initializers.serialize(self.initializer)}
        return dict(list(base_config.items()) + list(config.items()))


@example("keras_recipes/antirectifier")
def antirectifier():
    r = rng("antirectifier")
    x_train = r.random((54, 20)).astype("float32")  # 784 pixels published
    y_train = r.integers(0, 10, 54)
    x_test = r.random((19, 20)).astype("float32")
    y_test = r.integers(0, 10, 19)
    model = keras.Sequential(
        [
            keras.Input(shape=(20,)),
            layers.Dense(12),  # 256 published, each
            Antirectifier(),
            layers.Dense(12),
            Antirectifier(),
            layers.Dropout(0.5),
            layers.Dense(10),
        ]
    )
    model.compile(
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.RMSprop(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    # batch_size=128, epochs=20 published; 45 training rows after the split: 16 + 16 + 13.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=2, validation_split=0.15)
    return Port(model, fit, dict(x=x_test, y=y_test), dict(x=x_test))


class LogisticEndpoint(keras.layers.Layer):
    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            # Compute the training-time loss value and add it
            # to the layer using `self.add_loss()`.
            loss = self.loss_fn(targets, logits, sample_weight)
            self.add_loss(loss)
        # Return the inference-time prediction tensor (for `.predict()`).
        return ops.softmax(logits)


@example("keras_recipes/endpoint_layer_pattern")
def endpoint_layer_pattern():
    r = rng("endpoint_layer_pattern")
    inputs = keras.Input((16,), name="inputs")  # 764 published
    logits = keras.layers.Dense(1)(inputs)
    targets = keras.Input((1,), name="targets")
    sample_weight = keras.Input((1,), name="sample_weight")
    preds = LogisticEndpoint()(logits, targets, sample_weight)
    model = keras.Model([inputs, targets, sample_weight], preds)
    data = {
        "inputs": r.random((45, 16)).astype("float32"),  # 1000 rows published
        "targets": r.random((45, 1)).astype("float32"),
        "sample_weight": r.random((45, 1)).astype("float32"),
    }
    model.compile(keras.optimizers.Adam(1e-3))
    # Keras's default batch of 32: 32 + 13.
    fit = dict(x=data, epochs=2)
    return Port(model, fit, None, dict(x=data))


class MyTrainer(keras.Model):
    def __init__(self, model):
        super().__init__()
        self.model = model
        # Create loss and metrics here.
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.accuracy_metric = keras.metrics.SparseCategoricalAccuracy()

    @property
    def metrics(self):
        # List metrics here.
        return [self.accuracy_metric]

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)  # Forward pass
            # Compute loss value
            loss = self.loss_fn(y, y_pred)
        # Compute gradients
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        # Update weights
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        # Update metrics
        for metric in self.metrics:
            metric.update_state(y, y_pred)
        # Return a dict mapping metric names to current value.
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        # Inference step
        y_pred = self.model(x, training=False)
        # Update metrics
        for metric in self.metrics:
            metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def call(self, x):
        # Equivalent to `call()` of the wrapped keras.Model
        x = self.model(x)
        return x


@example("keras_recipes/trainer_pattern", backends=("tensorflow",))
def trainer_pattern():
    r = rng("trainer_pattern")
    x_train, y_train = r.random((37, 7, 7)), r.integers(0, 10, 37)  # 28 x 28 published
    x_test, y_test = r.random((13, 7, 7)), r.integers(0, 10, 13)
    model_a = keras.models.Sequential(
        [
            keras.Input((7, 7)),  # `Flatten(input_shape=(28, 28))` published
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),  # 256 published
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    trainer_1 = MyTrainer(model_a)
    trainer_1.compile(optimizer=keras.optimizers.SGD())
    # epochs=5, batch_size=64 published; float64 rows (`x_train / 255.0`) as published.
    fit = dict(x=x_train, y=y_train, epochs=2, batch_size=16, validation_data=(x_test, y_test))
    return Port(trainer_1, fit, dict(x=x_test, y=y_test), dict(x=x_test))


def embedding_encoder(vocabulary, embedding_dim, num_oov_indices=0, name=None):
    return keras.Sequential(
        [
            layers.StringLookup(
                vocabulary=vocabulary, mask_token=None, num_oov_indices=num_oov_indices
            ),
            layers.Embedding(input_dim=len(vocabulary) + num_oov_indices, output_dim=embedding_dim),
        ],
        name=f"{name}_embedding" if name else None,
    )


class QREmbedding(keras.layers.Layer):
    def __init__(self, vocabulary, embedding_dim, num_buckets, name=None):
        super().__init__(name=name)
        self.num_buckets = num_buckets
        self.index_lookup = layers.StringLookup(
            vocabulary=vocabulary, mask_token=None, num_oov_indices=0
        )
        self.q_embeddings = layers.Embedding(num_buckets, embedding_dim)
        self.r_embeddings = layers.Embedding(num_buckets, embedding_dim)

    def call(self, inputs):
        import tensorflow as tf

        embedding_index = self.index_lookup(inputs)
        quotient_index = tf.math.floordiv(embedding_index, self.num_buckets)
        remainder_index = tf.math.floormod(embedding_index, self.num_buckets)
        quotient_embedding = self.q_embeddings(quotient_index)
        remainder_embedding = self.r_embeddings(remainder_index)
        return quotient_embedding * remainder_embedding


class MDEmbedding(keras.layers.Layer):
    def __init__(self, blocks_vocabulary, blocks_embedding_dims, base_embedding_dim, name=None):
        import tensorflow as tf

        super().__init__(name=name)
        self.num_blocks = len(blocks_vocabulary)
        self.base_embedding_dim = base_embedding_dim  # a global of the example
        keys, values = [], []
        for block_idx, block_vocab in enumerate(blocks_vocabulary):
            keys.extend(block_vocab)
            values.extend([block_idx] * len(block_vocab))
        self.vocab_to_block = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(keys, values), default_value=-1
        )
        self.block_embedding_encoders = []
        self.block_embedding_projectors = []
        for idx in range(self.num_blocks):
            vocabulary = blocks_vocabulary[idx]
            embedding_dim = blocks_embedding_dims[idx]
            block_embedding_encoder = embedding_encoder(
                vocabulary, embedding_dim, num_oov_indices=1
            )
            self.block_embedding_encoders.append(block_embedding_encoder)
            if embedding_dim == base_embedding_dim:
                self.block_embedding_projectors.append(layers.Lambda(lambda x: x))
            else:
                self.block_embedding_projectors.append(layers.Dense(units=base_embedding_dim))

    def call(self, inputs):
        import tensorflow as tf

        block_indicies = self.vocab_to_block.lookup(inputs)
        embeddings = tf.zeros(shape=(tf.shape(inputs)[0], self.base_embedding_dim))
        for idx in range(self.num_blocks):
            block_embeddings = self.block_embedding_encoders[idx](inputs)
            block_embeddings = self.block_embedding_projectors[idx](block_embeddings)
            mask = tf.expand_dims(tf.cast(block_indicies == idx, tf.dtypes.float32), 1)
            block_embeddings = block_embeddings * mask
            embeddings += block_embeddings
        return embeddings


@example("keras_recipes/memory_efficient_embeddings", backends=("tensorflow",))
def memory_efficient_embeddings():
    import tensorflow as tf

    r = rng("memory_efficient_embeddings")
    user_vocabulary = [f"user_{i}" for i in range(20)]  # 6040 published
    movie_vocabulary = [f"movie_{i}" for i in range(30)]  # 3706 published
    base_embedding_dim = 8  # 64 published
    movie_blocks_vocabulary = [movie_vocabulary[:5], movie_vocabulary[5:15], movie_vocabulary[15:]]
    movie_blocks_embedding_dims = [8, 4, 2]  # [64, 32, 16] published
    user_embedding_num_buckets = len(user_vocabulary) // 4  # // 50 published: buckets >= quotients

    def dataset(n, batch_size=16):  # 128 published, read from CSV files
        features = {
            "user_id": np.array(user_vocabulary)[r.integers(0, 20, n)],
            "movie_id": np.array(movie_vocabulary)[r.integers(0, 30, n)],
        }
        ratings = r.integers(1, 6, n).astype("float32")
        return tf.data.Dataset.from_tensor_slices((features, ratings)).batch(batch_size)

    user_input = layers.Input(name="user_id", shape=(), dtype="string")
    user_embedding = QREmbedding(
        vocabulary=user_vocabulary,
        embedding_dim=base_embedding_dim,
        num_buckets=user_embedding_num_buckets,
        name="user_embedding",
    )(user_input)
    movie_input = layers.Input(name="movie_id", shape=(), dtype="string")
    movie_embedding = MDEmbedding(
        blocks_vocabulary=movie_blocks_vocabulary,
        blocks_embedding_dims=movie_blocks_embedding_dims,
        base_embedding_dim=base_embedding_dim,
        name="movie_embedding",
    )(movie_input)
    logits = layers.Dot(axes=1, name="dot_similarity")([user_embedding, movie_embedding])
    prediction = keras.activations.sigmoid(logits) * 5
    model = keras.Model(inputs=[user_input, movie_input], outputs=prediction, name="baseline_model")
    model.compile(
        optimizer=keras.optimizers.Adam(0.001),
        loss=keras.losses.MeanSquaredError(),
        metrics=[keras.metrics.MeanAbsoluteError(name="mae")],
    )
    eval_dataset = dataset(13)
    # num_epochs=3 published; 45 rows in batches of 16: 16 + 16 + 13.
    fit = dict(x=dataset(45), epochs=2, validation_data=eval_dataset)
    return Port(model, fit, dict(x=eval_dataset), dict(x=eval_dataset))
