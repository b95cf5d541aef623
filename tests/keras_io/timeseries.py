"""keras-io `examples/timeseries/`: timeseries_classification_from_scratch,
timeseries_classification_transformer, timeseries_weather_forecasting,
timeseries_anomaly_detection. Published code, shrunk."""

import keras
from keras import layers

from tests.keras_io._port import Port, example, rng


@example("timeseries/timeseries_classification_from_scratch")
def timeseries_classification_from_scratch():
    r = rng("timeseries_classification_from_scratch")
    num_classes = 2
    x_train = r.normal(size=(46, 24, 1)).astype("float32")  # (3601, 500, 1) published
    y_train = r.integers(0, num_classes, 46)
    x_test = r.normal(size=(13, 24, 1)).astype("float32")
    y_test = r.integers(0, num_classes, 13)
    input_layer = keras.layers.Input(x_train.shape[1:])
    conv1 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(input_layer)  # 64
    conv1 = keras.layers.BatchNormalization()(conv1)
    conv1 = keras.layers.ReLU()(conv1)
    conv2 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv1)
    conv2 = keras.layers.BatchNormalization()(conv2)
    conv2 = keras.layers.ReLU()(conv2)
    conv3 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same")(conv2)
    conv3 = keras.layers.BatchNormalization()(conv3)
    conv3 = keras.layers.ReLU()(conv3)
    gap = keras.layers.GlobalAveragePooling1D()(conv3)
    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)
    model = keras.models.Model(inputs=input_layer, outputs=output_layer)
    # The published ModelCheckpoint("best_model.keras") is left out: it only writes a file.
    callbacks = [
        keras.callbacks.ReduceLROnPlateau(
            monitor="val_loss", factor=0.5, patience=20, min_lr=0.0001
        ),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=0),
    ]
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    # batch_size=32, epochs=500 published; 36 training rows after the split: 16 + 16 + 4.
    fit = dict(
        x=x_train, y=y_train, batch_size=16, epochs=3, callbacks=callbacks, validation_split=0.2
    )
    return Port(model, fit, dict(x=x_test, y=y_test), dict(x=x_test))


def transformer_encoder(inputs, head_size, num_heads, ff_dim, dropout=0):
    # Attention and Normalization
    x = layers.MultiHeadAttention(key_dim=head_size, num_heads=num_heads, dropout=dropout)(
        inputs, inputs
    )
    x = layers.Dropout(dropout)(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    res = x + inputs
    # Feed Forward Part
    x = layers.Conv1D(filters=ff_dim, kernel_size=1, activation="relu")(res)
    x = layers.Dropout(dropout)(x)
    x = layers.Conv1D(filters=inputs.shape[-1], kernel_size=1)(x)
    x = layers.LayerNormalization(epsilon=1e-6)(x)
    return x + res


@example("timeseries/timeseries_classification_transformer")
def timeseries_classification_transformer():
    r = rng("timeseries_classification_transformer")
    n_classes = 2
    x_train = r.normal(size=(46, 16, 1)).astype("float32")  # (3601, 500, 1) published
    y_train = r.integers(0, n_classes, 46)
    x_test = r.normal(size=(13, 16, 1)).astype("float32")
    y_test = r.integers(0, n_classes, 13)
    inputs = keras.Input(shape=x_train.shape[1:])
    x = inputs
    # head_size=256, num_heads=4, ff_dim=4, num_transformer_blocks=4, mlp_units=[128],
    # mlp_dropout=0.4, dropout=0.25 published.
    for _ in range(1):
        x = transformer_encoder(x, head_size=8, num_heads=2, ff_dim=4, dropout=0.25)
    x = layers.GlobalAveragePooling1D(data_format="channels_last")(x)
    for dim in [8]:
        x = layers.Dense(dim, activation="relu")(x)
        x = layers.Dropout(0.4)(x)
    outputs = layers.Dense(n_classes, activation="softmax")(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        loss="sparse_categorical_crossentropy",
        optimizer=keras.optimizers.Adam(learning_rate=1e-4),
        metrics=["sparse_categorical_accuracy"],
    )
    callbacks = [keras.callbacks.EarlyStopping(patience=10, restore_best_weights=True)]
    # epochs=150, batch_size=64 published.
    fit = dict(
        x=x_train, y=y_train, validation_split=0.2, epochs=2, batch_size=16, callbacks=callbacks
    )
    return Port(model, fit, dict(x=x_test, y=y_test), dict(x=x_test))


@example("timeseries/timeseries_weather_forecasting")
def timeseries_weather_forecasting():
    r = rng("timeseries_weather_forecasting")
    sequence_length, step, batch_size = 12, 2, 16  # 120, 6, 256 published
    features = r.normal(size=(160, 7)).astype("float32")  # 7 features, as published
    x_train, y_train = features[:80], features[24:104, 1:2]
    x_val, y_val = features[80:-24], features[104:, 1:2]
    dataset_train = keras.preprocessing.timeseries_dataset_from_array(
        x_train, y_train, sequence_length=sequence_length, sampling_rate=step,
        batch_size=batch_size,
    )  # fmt: skip
    dataset_val = keras.preprocessing.timeseries_dataset_from_array(
        x_val, y_val, sequence_length=sequence_length, sampling_rate=step,
        batch_size=batch_size,
    )  # fmt: skip
    for batch in dataset_train.take(1):
        inputs, targets = batch
    inputs = keras.layers.Input(shape=(inputs.shape[1], inputs.shape[2]))
    lstm_out = keras.layers.LSTM(8)(inputs)  # 32 published
    outputs = keras.layers.Dense(1)(lstm_out)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    # The published ModelCheckpoint is left out: it only writes a file.
    es_callback = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5)
    # epochs=10 published; 58 windows of training (16 + 16 + 16 + 10), 34 of validation.
    fit = dict(x=dataset_train, epochs=2, validation_data=dataset_val, callbacks=[es_callback])
    return Port(model, fit, dict(x=dataset_val), dict(x=dataset_val))


@example("timeseries/timeseries_anomaly_detection")
def timeseries_anomaly_detection():
    r = rng("timeseries_anomaly_detection")
    x_train = r.normal(size=(47, 24, 1)).astype("float32")  # (3745, 288, 1) published
    model = keras.Sequential(
        [
            layers.Input(shape=(x_train.shape[1], x_train.shape[2])),
            layers.Conv1D(filters=4, kernel_size=7, padding="same", strides=2, activation="relu"),
            layers.Dropout(rate=0.2),
            layers.Conv1D(filters=2, kernel_size=7, padding="same", strides=2, activation="relu"),
            layers.Conv1DTranspose(
                filters=2, kernel_size=7, padding="same", strides=2, activation="relu"
            ),
            layers.Dropout(rate=0.2),
            layers.Conv1DTranspose(
                filters=4, kernel_size=7, padding="same", strides=2, activation="relu"
            ),
            layers.Conv1DTranspose(filters=1, kernel_size=7, padding="same"),
        ]
    )  # filters 32, 16, 16, 32 published
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
    # epochs=50, batch_size=128 published; 42 training rows after the split: 16 + 16 + 10.
    fit = dict(
        x=x_train,
        y=x_train,
        epochs=2,
        batch_size=16,
        validation_split=0.1,
        callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=5, mode="min")],
    )
    return Port(model, fit, None, dict(x=x_train))
