"""keras-io `examples/nlp/`: text_classification_with_transformer, bidirectional_lstm_imdb,
pretrained_word_embeddings, text_classification_from_scratch, addition_rnn. Published code,
shrunk (vocabularies, widths, sequence lengths, rows, epochs)."""

import keras
from keras import layers, ops

from tests.keras_io._port import Port, example, rng


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def _tokens(r, rows, maxlen, vocab_size):
    return r.integers(0, vocab_size, (rows, maxlen)).astype("int32")


@example("nlp/text_classification_with_transformer")
def text_classification_with_transformer():
    r = rng("text_classification_with_transformer")
    vocab_size, maxlen = 50, 10  # 20000 and 200 published
    x_train, y_train = _tokens(r, 37, maxlen, vocab_size), r.integers(0, 2, 37)
    x_val, y_val = _tokens(r, 13, maxlen, vocab_size), r.integers(0, 2, 13)
    embed_dim, num_heads, ff_dim = 8, 2, 8  # 32, 2, 32 published
    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    # batch_size=32 published; 16 here: 16 + 16 + 5.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=2, validation_data=(x_val, y_val))
    return Port(model, fit, dict(x=x_val, y=y_val), dict(x=x_val))


@example("nlp/bidirectional_lstm_imdb")
def bidirectional_lstm_imdb():
    r = rng("bidirectional_lstm_imdb")
    max_features, maxlen = 50, 8  # 20000 and 200 published
    x_train, y_train = _tokens(r, 37, maxlen, max_features), r.integers(0, 2, 37)
    x_val, y_val = _tokens(r, 13, maxlen, max_features), r.integers(0, 2, 13)
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(max_features, 8)(inputs)  # 128 published
    x = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(x)  # 64 published
    x = layers.Bidirectional(layers.LSTM(4))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    # batch_size=32 published.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=2, validation_data=(x_val, y_val))
    return Port(model, fit, dict(x=x_val, y=y_val), dict(x=x_val))


@example("nlp/pretrained_word_embeddings")
def pretrained_word_embeddings():
    r = rng("pretrained_word_embeddings")
    num_tokens, embedding_dim, classes = 40, 4, 20  # 20002, 100 published; 20 newsgroups
    # 200 tokens a text, as published: three Conv1D(5) and two MaxPooling1D(5) need them.
    x_train, y_train = _tokens(r, 37, 200, num_tokens), r.integers(0, classes, 37)
    x_val, y_val = _tokens(r, 13, 200, num_tokens), r.integers(0, classes, 13)
    embedding_matrix = r.normal(size=(num_tokens, embedding_dim)).astype("float32")  # GloVe
    embedding_layer = layers.Embedding(num_tokens, embedding_dim, trainable=False)
    embedding_layer.build((1,))
    embedding_layer.set_weights([embedding_matrix])
    int_sequences_input = keras.Input(shape=(None,), dtype="int32")
    embedded_sequences = embedding_layer(int_sequences_input)
    x = layers.Conv1D(8, 5, activation="relu")(embedded_sequences)  # 128 published, each
    x = layers.MaxPooling1D(5)(x)
    x = layers.Conv1D(8, 5, activation="relu")(x)
    x = layers.MaxPooling1D(5)(x)
    x = layers.Conv1D(8, 5, activation="relu")(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    preds = layers.Dense(classes, activation="softmax")(x)
    model = keras.Model(int_sequences_input, preds)
    model.compile(loss="sparse_categorical_crossentropy", optimizer="rmsprop", metrics=["acc"])
    # batch_size=128, epochs=20 published.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=2, validation_data=(x_val, y_val))
    return Port(model, fit, dict(x=x_val, y=y_val), dict(x=x_val))


@example("nlp/text_classification_from_scratch")
def text_classification_from_scratch():
    r = rng("text_classification_from_scratch")
    max_features, embedding_dim, length = 50, 8, 30  # 20000, 128, 500 published
    # The published pipeline vectorizes text in tf.data; the model receives int64 tokens.
    x_train = r.integers(0, max_features, (45, length)).astype("int64")
    y_train = r.integers(0, 2, (45, 1)).astype("int64")
    x_val = r.integers(0, max_features, (13, length)).astype("int64")
    y_val = r.integers(0, 2, (13, 1)).astype("int64")
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(max_features, embedding_dim)(inputs)
    x = layers.Dropout(0.5)(x)
    x = layers.Conv1D(8, 7, padding="valid", activation="relu", strides=3)(x)  # 128 published
    x = layers.Conv1D(8, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(8, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    # Batches of 32 (the dataset's), epochs=3 published: 32 + 13.
    fit = dict(x=x_train, y=y_train, batch_size=32, epochs=2, validation_data=(x_val, y_val))
    return Port(model, fit, dict(x=x_val, y=y_val), dict(x=x_val))


@example("nlp/addition_rnn")
def addition_rnn():
    r = rng("addition_rnn")
    digits, chars = 3, 12  # "0123456789+ "
    maxlen = digits + 1 + digits

    def one_hot(n, length):  # bool, as the example's vectorization
        return keras.utils.to_categorical(r.integers(0, chars, (n, length)), chars).astype(bool)

    x_train, y_train = one_hot(37, maxlen), one_hot(37, digits + 1)
    x_val, y_val = one_hot(13, maxlen), one_hot(13, digits + 1)
    num_layers = 1
    model = keras.Sequential()
    model.add(layers.Input((maxlen, chars)))
    model.add(layers.LSTM(8))  # 128 published, each
    model.add(layers.RepeatVector(digits + 1))
    for _ in range(num_layers):
        model.add(layers.LSTM(8, return_sequences=True))
    model.add(layers.Dense(chars, activation="softmax"))
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    # batch_size=32 published, one epoch per iteration of its loop.
    fit = dict(x=x_train, y=y_train, batch_size=16, epochs=1, validation_data=(x_val, y_val))
    return Port(model, fit, dict(x=x_val, y=y_val), dict(x=x_val))
