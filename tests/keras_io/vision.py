"""keras-io `examples/vision/`: mnist_convnet, knowledge_distillation, siamese_contrastive,
autoencoder, oxford_pets_image_segmentation. Published code, shrunk (fewer filters, smaller
images, fewer rows and epochs). conv_lstm and image_classification_from_scratch were ported
too and passed on JAX and TensorFlow, but cost 50-70 s a backend (ConvLSTM2D's loops; the same
residual blocks as oxford_pets): left out for the suite's time."""

import keras
from keras import layers, ops

from tests.keras_io._port import Port, example, rng


@example("vision/mnist_convnet")
def mnist_convnet():
    r = rng("mnist_convnet")
    num_classes = 10
    input_shape = (12, 12, 1)  # 28 x 28 published
    x_train = r.random((53, *input_shape)).astype("float32")
    y_train = keras.utils.to_categorical(r.integers(0, 10, 53), num_classes)
    x_test = r.random((21, *input_shape)).astype("float32")
    y_test = keras.utils.to_categorical(r.integers(0, 10, 21), num_classes)
    model = keras.Sequential(
        [
            keras.Input(shape=input_shape),
            layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),  # 32 published
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),  # 64 published
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.5),
            layers.Dense(num_classes, activation="softmax"),
        ]
    )
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    # batch_size=128, epochs=15 published; 47 training rows after the split: 16 + 16 + 15.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=2, validation_split=0.1)
    return Port(model, fit, dict(x=x_test, y=y_test), dict(x=x_test))


class Distiller(keras.Model):
    """keras-io's Keras 3 Distiller: `compute_loss` overridden, `sample_weight` unused."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer,
        metrics,
        student_loss_fn,
        distillation_loss_fn,
        alpha=0.1,
        temperature=3,
    ):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature**2)
        loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        return loss

    def call(self, x):
        return self.student(x)


def _distillation_net(name, filters):
    return keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),  # 28 x 28 published
            layers.Conv2D(filters, (3, 3), strides=(2, 2), padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
            layers.Conv2D(2 * filters, (3, 3), strides=(2, 2), padding="same"),
            layers.Flatten(),
            layers.Dense(10),
        ],
        name=name,
    )


@example("vision/knowledge_distillation")
def knowledge_distillation():
    r = rng("knowledge_distillation")
    x_train = r.random((45, 8, 8, 1)).astype("float32")
    y_train = r.integers(0, 10, 45)
    x_test = r.random((19, 8, 8, 1)).astype("float32")
    y_test = r.integers(0, 10, 19)
    # The teacher is trained by a plain fit first in the example; here it keeps its initial
    # weights (the distillation's arithmetic is the same).
    teacher = _distillation_net("teacher", 8)  # 256 published
    student = _distillation_net("student", 4)  # 16 published
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(
        optimizer=keras.optimizers.Adam(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=keras.losses.KLDivergence(),
        alpha=0.1,
        temperature=10,
    )
    # epochs=3 published, Keras's default batch of 32: 32 + 13.
    fit = dict(x=x_train, y=y_train, epochs=2)
    return Port(distiller, fit, dict(x=x_test, y=y_test), dict(x=x_test))


def euclidean_distance(vects):
    x, y = vects
    sum_square = ops.sum(ops.square(x - y), axis=1, keepdims=True)
    return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))


def contrastive(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - (y_pred), 0))
        return ops.mean((1 - y_true) * square_pred + (y_true) * margin_square)

    return contrastive_loss


@example("vision/siamese_contrastive")
def siamese_contrastive():
    r = rng("siamese_contrastive")
    shape = (12, 12, 1)  # 28 x 28 published

    def pairs(n):
        x = r.random((2, n, *shape)).astype("float32")
        return [x[0], x[1]], r.integers(0, 2, n).astype("float32")

    train, labels_train = pairs(37)
    val, labels_val = pairs(13)
    test, labels_test = pairs(11)
    input = keras.layers.Input(shape)
    x = keras.layers.BatchNormalization()(input)
    x = keras.layers.Conv2D(4, (3, 3), activation="tanh")(x)  # (5, 5) published
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Conv2D(4, (3, 3), activation="tanh")(x)  # 16 published
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dense(10, activation="tanh")(x)
    embedding_network = keras.Model(input, x)
    input_1 = keras.layers.Input(shape)
    input_2 = keras.layers.Input(shape)
    tower_1 = embedding_network(input_1)
    tower_2 = embedding_network(input_2)
    merge_layer = keras.layers.Lambda(euclidean_distance, output_shape=(1,))([tower_1, tower_2])
    normal_layer = keras.layers.BatchNormalization()(merge_layer)
    output_layer = keras.layers.Dense(1, activation="sigmoid")(normal_layer)
    siamese = keras.Model(inputs=[input_1, input_2], outputs=output_layer)
    siamese.compile(loss=contrastive(margin=1), optimizer="RMSprop", metrics=["accuracy"])
    # batch_size=16, epochs=10 published.
    fit = dict(x=train, y=labels_train, validation_data=(val, labels_val), batch_size=16, epochs=2)
    return Port(siamese, fit, dict(x=test, y=labels_test), dict(x=test))


@example("vision/autoencoder")
def autoencoder():
    r = rng("autoencoder")
    train_data = r.random((37, 8, 8, 1)).astype("float32")  # 28 x 28 published
    test_data = r.random((13, 8, 8, 1)).astype("float32")
    input = layers.Input(shape=(8, 8, 1))
    x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(input)  # 32 published
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2D(4, (3, 3), activation="relu", padding="same")(x)
    x = layers.MaxPooling2D((2, 2), padding="same")(x)
    x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2DTranspose(4, (3, 3), strides=2, activation="relu", padding="same")(x)
    x = layers.Conv2D(1, (3, 3), activation="sigmoid", padding="same")(x)
    autoencoder = keras.Model(input, x)
    autoencoder.compile(optimizer="adam", loss="binary_crossentropy")
    # epochs=50, batch_size=128, shuffle=True published (the test fits unshuffled).
    fit = dict(
        x=train_data,
        y=train_data,
        epochs=2,
        batch_size=16,
        validation_data=(test_data, test_data),
    )
    return Port(autoencoder, fit, dict(x=test_data, y=test_data), dict(x=test_data))


def _xception_blocks(x, sizes):
    """oxford_pets_image_segmentation's downsampling blocks, as published."""
    previous_block_activation = x
    for filters in sizes:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(filters, 1, strides=2, padding="same")(previous_block_activation)
        x = layers.add([x, residual])
        previous_block_activation = x
    return x


@example("vision/oxford_pets_image_segmentation")
def oxford_pets_image_segmentation():
    r = rng("oxford_pets_image_segmentation")
    img_size, num_classes = (16, 16), 3  # (160, 160) published
    images = r.random((24, *img_size, 3)).astype("float32")
    masks = r.integers(0, num_classes, (24, *img_size, 1)).astype("uint8")
    inputs = keras.Input(shape=img_size + (3,))
    x = layers.Conv2D(4, 3, strides=2, padding="same")(inputs)  # 32 published
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = _xception_blocks(x, [4])  # [64, 128, 256] published
    previous_block_activation = x
    for filters in [4, 2]:  # [256, 128, 64, 32] published
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.Conv2DTranspose(filters, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.UpSampling2D(2)(x)
        residual = layers.UpSampling2D(2)(previous_block_activation)
        residual = layers.Conv2D(filters, 1, padding="same")(residual)
        x = layers.add([x, residual])
        previous_block_activation = x
    outputs = layers.Conv2D(num_classes, 3, activation="softmax", padding="same")(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    # Batches of 64 and 50 epochs published; 19 training rows in batches of 8: 8 + 8 + 3.
    fit = dict(
        x=images[:19], y=masks[:19], batch_size=8, epochs=1,
        validation_data=(images[19:], masks[19:]),
    )  # fmt: skip
    return Port(model, fit, None, dict(x=images[19:]))
