"""keras-io `examples/structured_data/`: imbalanced_classification,
collaborative_filtering_movielens. Published code, shrunk."""

import keras
import numpy as np
from keras import layers, ops

from tests.keras_io._port import Port, example, rng


@example("structured_data/imbalanced_classification")
def imbalanced_classification():
    r = rng("imbalanced_classification")
    features = r.normal(size=(77, 29)).astype("float32")  # 30 columns, the last the class
    targets = (r.random((77, 1)) < 0.2).astype("uint8")
    train_features, val_features = features[:61], features[61:]
    train_targets, val_targets = targets[:61], targets[61:]
    counts = np.bincount(train_targets[:, 0])
    weight_for_0 = 1.0 / counts[0]
    weight_for_1 = 1.0 / counts[1]
    model = keras.Sequential(
        [
            keras.Input(shape=train_features.shape[1:]),
            keras.layers.Dense(16, activation="relu"),  # 256 published, each
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    metrics = [
        keras.metrics.FalseNegatives(name="fn"),
        keras.metrics.FalsePositives(name="fp"),
        keras.metrics.TrueNegatives(name="tn"),
        keras.metrics.TruePositives(name="tp"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall"),
    ]
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics
    )
    class_weight = {0: weight_for_0, 1: weight_for_1}
    # batch_size=2048, epochs=30 published (the per-epoch ModelCheckpoint left out: files);
    # 61 rows in batches of 16: 16 + 16 + 16 + 13.
    fit = dict(
        x=train_features,
        y=train_targets,
        batch_size=16,
        epochs=2,
        validation_data=(val_features, val_targets),
        class_weight=class_weight,
    )
    return Port(model, fit, dict(x=val_features, y=val_targets), dict(x=val_features))


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.num_users = num_users
        self.num_movies = num_movies
        self.embedding_size = embedding_size
        self.user_embedding = layers.Embedding(
            num_users,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies,
            embedding_size,
            embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6),
        )
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        # As published: a contraction over both axes, one number for the whole batch.
        dot_user_movie = ops.tensordot(user_vector, movie_vector, 2)
        x = dot_user_movie + user_bias + movie_bias
        return ops.nn.sigmoid(x)


@example("structured_data/collaborative_filtering_movielens")
def collaborative_filtering_movielens():
    r = rng("collaborative_filtering_movielens")
    num_users, num_movies = 12, 20  # 610 and 9724 published
    x = np.stack([r.integers(0, num_users, 77), r.integers(0, num_movies, 77)], axis=1)
    y = r.random(77).astype("float32")  # ratings scaled to [0, 1]
    x_train, x_val, y_train, y_val = x[:61], x[61:], y[:61], y[61:]
    model = RecommenderNet(num_users, num_movies, 4)  # EMBEDDING_SIZE = 50 published
    model(x_train[:2])  # built, so that its weights can be copied
    model.compile(
        loss=keras.losses.BinaryCrossentropy(),
        optimizer=keras.optimizers.Adam(learning_rate=0.001),
    )
    # batch_size=64, epochs=5 published; 61 rows in batches of 16.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=2, validation_data=(x_val, y_val))
    return Port(model, fit, dict(x=x_val, y=y_val), dict(x=x_val))
