"""Seed models match the seed layer for layer; FLOPs match hand counts; BERT builds offline."""

import math
import sys

import keras
import numpy as np
import pytest

from keras_accel.data.text import synthetic_text_classification, text_vocabulary

try:
    # Imported at collection, not inside a test: keras-hub imports TensorFlow, whose first
    # import sets environment variables (TF2_BEHAVIOR...) that the conftest leak guard would
    # blame on whichever test happened to import it first.
    import keras_hub
except ImportError:  # the optional `nlp` extra is absent: the BERT tests skip
    keras_hub = None

from keras_accel.models import (
    bert_classifier,
    cnn,
    compile_seed,
    forward_flops,
    mlp,
    seed_compile_kwargs,
    training_flops,
)

SEED_MLP_UNITS = [2048, 1024, 512, 256, 128, 64, 32, 16]
SEED_CNN_FILTERS = [96, 256, 384, 384, 256]


needs_keras_hub = pytest.mark.skipif(keras_hub is None, reason="keras-hub not installed")


def _of_type(model, cls):
    return [layer for layer in model.layers if type(layer) is cls]


def _activation(layer):
    # The function's name, not get_config(): serialising a config imports TensorFlow.
    return layer.activation.__name__


# Full-size seed models are built once per module: building one costs seconds on a CPU.
@pytest.fixture(scope="module")
def seed_mlp():
    return mlp()


@pytest.fixture(scope="module")
def seed_cnn():
    return cnn()


# --------------------------------------------------------------------------- MLP


def test_mlp_layer_sequence_is_the_seed(seed_mlp):
    model = seed_mlp
    kinds = [type(layer).__name__ for layer in model.layers]
    block = ["Dense", "BatchNormalization", "Activation", "Dropout"]
    assert kinds == ["InputLayer", "Flatten", *block * 8, "Dense"]
    assert model.input_shape == (None, 32, 32, 3)
    assert model.output_shape == (None, 10)


def test_mlp_units_rates_and_params(seed_mlp):
    model = seed_mlp
    dense = _of_type(model, keras.layers.Dense)
    assert [d.units for d in dense] == [*SEED_MLP_UNITS, 10]
    assert [_activation(d) for d in dense] == ["linear"] * 8 + ["softmax"]
    fan_in = [3072, *SEED_MLP_UNITS]
    assert [d.count_params() for d in dense] == [
        i * u + u for i, u in zip(fan_in, [*SEED_MLP_UNITS, 10])
    ]
    assert [d.rate for d in _of_type(model, keras.layers.Dropout)] == [0.5] * 8
    assert [_activation(a) for a in _of_type(model, keras.layers.Activation)] == ["relu"] * 8
    bns = _of_type(model, keras.layers.BatchNormalization)
    assert [bn.count_params() for bn in bns] == [4 * u for u in SEED_MLP_UNITS]
    # Keras 3 keeps the TF 1.11 BatchNormalization defaults the seed relied on.
    assert {(bn.momentum, bn.epsilon) for bn in bns} == {(0.99, 1e-3)}
    dense_params = sum(i * u + u for i, u in zip(fan_in, [*SEED_MLP_UNITS, 10]))
    assert model.count_params() == dense_params + 4 * sum(SEED_MLP_UNITS) == 9_108_058
    non_trainable = sum(math.prod(w.shape) for w in model.non_trainable_weights)
    assert non_trainable == 2 * sum(SEED_MLP_UNITS)  # moving mean and variance


def test_mlp_flat_input_is_exactly_the_seed_graph(seed_mlp):
    model = mlp(input_shape=(3072,))
    assert not _of_type(model, keras.layers.Flatten)
    assert model.count_params() == seed_mlp.count_params()


def test_mlp_layers_are_named(seed_mlp):
    model = seed_mlp
    for i in range(1, 9):
        for part in ("dense", "bn", "relu", "dropout"):
            model.get_layer(f"block{i}_{part}")
    assert model.get_layer("predictions").units == 10


def test_mlp_forward_pass_gives_probabilities(seed_mlp):
    model = seed_mlp
    x = np.random.default_rng(0).random((2, 32, 32, 3), dtype=np.float32)
    y = model.predict_on_batch(x)  # one compiled call: op-by-op eager is slower on JAX
    assert y.shape == (2, 10)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


def test_mlp_width_and_num_classes():
    model = mlp(num_classes=3, width=0.5)
    units = [d.units for d in _of_type(model, keras.layers.Dense)]
    assert units == [u // 2 for u in SEED_MLP_UNITS] + [3]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"width": 0}, "width"),
        ({"input_shape": (0, 3)}, "input_shape"),
    ],
)
def test_mlp_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mlp(**kwargs)


# --------------------------------------------------------------------------- CNN


def test_cnn_layer_sequence_is_the_seed(seed_cnn):
    model = seed_cnn
    kinds = [type(layer).__name__ for layer in model.layers]
    block = ["Conv2D", "BatchNormalization", "Activation"]
    pool = ["AveragePooling2D"]
    expected = ["InputLayer", *block, *pool, *block, *pool, *block * 3, "Flatten", "Dense"]
    assert kinds == expected


def test_cnn_filters_shapes_and_params(seed_cnn):
    model = seed_cnn
    convs = _of_type(model, keras.layers.Conv2D)
    assert [c.filters for c in convs] == SEED_CNN_FILTERS
    assert {(c.kernel_size, c.strides, c.padding) for c in convs} == {((3, 3), (1, 1), "same")}
    pools = _of_type(model, keras.layers.AveragePooling2D)
    assert [(p.pool_size, p.strides, p.padding) for p in pools] == [((2, 2), (2, 2), "valid")] * 2
    assert [model.get_layer(f"block{i}_relu").output.shape[1:] for i in range(1, 6)] == [
        (32, 32, 96),
        (16, 16, 256),
        (8, 8, 384),
        (8, 8, 384),
        (8, 8, 256),
    ]
    fan_in = [3, *SEED_CNN_FILTERS[:-1]]
    conv_params = [9 * i * c + c for i, c in zip(fan_in, SEED_CNN_FILTERS)]
    assert [c.count_params() for c in convs] == conv_params
    head = model.get_layer("predictions")
    assert (head.units, _activation(head)) == (10, "softmax")
    assert head.count_params() == 8 * 8 * 256 * 10 + 10
    total = sum(conv_params) + 4 * sum(SEED_CNN_FILTERS) + head.count_params()
    assert model.count_params() == total == 3_491_082


def test_cnn_forward_pass_gives_probabilities(seed_cnn):
    model = seed_cnn
    x = np.random.default_rng(0).random((2, 32, 32, 3), dtype=np.float32)
    y = model.predict_on_batch(x)  # one compiled call: op-by-op eager is slower on JAX
    assert y.shape == (2, 10)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


def test_cnn_rejects_non_image_shape():
    with pytest.raises(ValueError, match="3 positive integers"):
        cnn(input_shape=(3072,))


# --------------------------------------------------------------------------- compile settings


def test_compile_seed_uses_the_seed_settings():
    inputs = keras.Input((4,))
    model = compile_seed(keras.Model(inputs, keras.layers.Dense(10, "softmax")(inputs)))
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert np.isclose(float(model.optimizer.learning_rate), 1e-3)
    assert model.loss == "categorical_crossentropy"
    x = np.random.default_rng(0).random((8, 4), dtype=np.float32)
    y = np.eye(10, dtype=np.float32)[np.arange(8)]
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert set(history.history) == {"loss", "accuracy"}


def test_bert_recipe_and_overrides():
    kwargs = seed_compile_kwargs("bert")
    assert np.isclose(float(kwargs["optimizer"].learning_rate), 3e-5)
    assert np.isclose(kwargs["optimizer"].epsilon, 1e-8)
    # On logits [2, 0] for class 0: -log softmax = log(1 + e^-2), not ~0 as for probabilities.
    loss = float(kwargs["loss"](np.array([0]), np.array([[2.0, 0.0]])))
    assert np.isclose(loss, np.log1p(np.exp(-2.0)), rtol=1e-4)
    lr = seed_compile_kwargs("cifar10", learning_rate=0.1)["optimizer"].learning_rate
    assert np.isclose(float(lr), 0.1)
    # A fresh optimizer per call, so each can be created inside its distribution scope.
    assert seed_compile_kwargs()["optimizer"] is not seed_compile_kwargs()["optimizer"]


def test_unknown_recipe_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"\['cifar10', 'bert'\].*recipe='imagenet'"):
        seed_compile_kwargs("imagenet")


# --------------------------------------------------------------------------- FLOPs


def test_flops_of_dense_layers_by_hand():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    macs = 4 * 3 + 3 * 2
    assert forward_flops(model) == 2 * macs
    assert forward_flops(model, batch_size=5) == 2 * 5 * macs
    assert training_flops(model, batch_size=5) == 3 * 2 * 5 * macs == 540


def test_flops_of_convolutions_by_hand():
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)  # 8x8 outputs x (3*3*2) x 4
    x = keras.layers.BatchNormalization()(x)  # not counted
    x = keras.layers.Conv2D(3, 3, strides=2)(x)  # valid: 3x3 outputs x (3*3*4) x 3
    x = keras.layers.Flatten()(x)
    model = keras.Model(inputs, keras.layers.Dense(5)(x))  # 27 x 5
    macs = 64 * 72 + 9 * 108 + 27 * 5
    assert macs == 5715
    assert forward_flops(model, 1) == 2 * macs
    assert training_flops(model, 4) == 6 * 4 * macs


def test_flops_channels_first_rank3_dense_and_nested_models():
    inner_in = keras.Input((2, 8, 8))
    inner = keras.Model(
        inner_in, keras.layers.Conv2D(4, 3, padding="same", data_format="channels_first")(inner_in)
    )
    inputs = keras.Input((2, 8, 8))
    x = inner(inputs)  # (4, 8, 8): 64 positions x 72
    x = keras.layers.Reshape((4, 64))(x)
    model = keras.Model(inputs, keras.layers.Dense(3)(x))  # 4 positions x 64 x 3
    assert forward_flops(model) == 2 * (64 * 72 + 4 * 64 * 3)


def test_flops_of_the_seed_models(seed_mlp, seed_cnn):
    cnn_macs = (
        32 * 32 * 9 * 3 * 96
        + 16 * 16 * 9 * 96 * 256
        + 8 * 8 * 9 * 256 * 384
        + 8 * 8 * 9 * 384 * 384
        + 8 * 8 * 9 * 384 * 256
        + 8 * 8 * 256 * 10
    )
    assert training_flops(seed_cnn, 1024) == 3 * 2 * 1024 * cnn_macs
    fan_in = [3072, *SEED_MLP_UNITS]
    mlp_macs = sum(i * u for i, u in zip(fan_in, [*SEED_MLP_UNITS, 10]))
    assert training_flops(seed_mlp, 256) == 3 * 2 * 256 * mlp_macs


def test_flops_rejects_shared_layers_and_bad_batch_size():
    dense = keras.layers.Dense(2)
    inputs = keras.Input((2,))
    model = keras.Model(inputs, dense(dense(inputs)))
    with pytest.raises(ValueError, match="exactly once"):
        forward_flops(model)
    with pytest.raises(ValueError, match="batch_size"):
        training_flops(mlp(width=1 / 64), 0)


# --------------------------------------------------------------------------- BERT


TINY_BERT = {"sequence_length": 16, "num_layers": 1, "hidden_dim": 16, "num_heads": 2}


@needs_keras_hub
def test_bert_classifier_fits_and_predicts_offline():
    model = bert_classifier(
        num_classes=3, vocabulary=text_vocabulary(), intermediate_dim=32, **TINY_BERT
    )
    assert model.backbone.num_layers == 1 and model.backbone.hidden_dim == 16
    assert model.preprocessor.sequence_length == 16
    compile_seed(model, "bert")
    (x, y), (x_test, _) = synthetic_text_classification(8, 3, num_classes=3)
    # shuffle=False: keras-hub feeds fit a tf.data pipeline, which Keras will not shuffle.
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model.predict(x_test, verbose=0).shape == (3, 3)


@needs_keras_hub
def test_bert_classifier_loads_a_local_preset(tmp_path, monkeypatch):
    saved = bert_classifier(num_classes=2, intermediate_dim=32, **TINY_BERT)
    directory = tmp_path / "my_preset"
    saved.save_to_preset(str(directory))
    sentences = np.array(["the team scored a goal .", "rain and wind today ."])
    expected = saved.predict(sentences, verbose=0)

    # Same num_classes: the trained head comes back with the backbone.
    loaded = bert_classifier(num_classes=2, preset=str(directory), sequence_length=16)
    np.testing.assert_allclose(loaded.predict(sentences, verbose=0), expected, atol=1e-5)
    # Another num_classes: the backbone is reused under a new head.
    regrown = bert_classifier(num_classes=3, preset=str(directory), sequence_length=16)
    assert regrown.predict(sentences, verbose=0).shape == (2, 3)
    with pytest.raises(ValueError, match="max_sequence_length=16"):
        bert_classifier(preset=str(directory), sequence_length=32)

    # A named preset is used when it is already in the kagglehub cache (no network).
    cache = tmp_path / "kagglehub"
    named = cache / "models" / "keras" / "bert" / "keras" / "bert_tiny_en_uncased" / "3"
    saved.save_to_preset(str(named))
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(cache))
    from_cache = bert_classifier(num_classes=2, preset="bert_tiny_en_uncased", sequence_length=16)
    assert from_cache.predict(sentences, verbose=0).shape == (2, 2)


@needs_keras_hub
def test_missing_named_preset_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        bert_classifier(preset="bert_tiny_en_uncased")
    message = str(info.value)
    assert "'bert_tiny_en_uncased' was not found locally" in message
    assert "no download is attempted" in message
    assert str(tmp_path / "models" / "keras" / "bert" / "keras" / "bert_tiny_en_uncased") in message


@needs_keras_hub
@pytest.mark.parametrize(
    "preset, match",
    [
        ("kaggle://keras/bert/keras/bert_tiny_en_uncased/3", "does not download"),
        ("no_such_preset", "Known keras-hub BERT preset names"),
    ],
)
def test_remote_and_unknown_presets_are_refused(preset, match, tmp_path, monkeypatch):
    monkeypatch.setenv("KAGGLEHUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=match):
        bert_classifier(preset=preset)


@needs_keras_hub
def test_directory_without_config_is_not_a_preset(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        bert_classifier(preset=str(tmp_path))


@needs_keras_hub
def test_bert_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        bert_classifier(vocabulary=text_vocabulary(), preset="bert_tiny_en_uncased")
    with pytest.raises(ValueError, match=r"lacks \['\[MASK\]'\]"):
        bert_classifier(vocabulary=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        bert_classifier(vocabulary=str(tmp_path / "vocab.txt"))
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    with pytest.raises(ValueError, match=r"vocab.txt lacks \['\[MASK\]'\]"):
        bert_classifier(vocabulary=tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match="divisible"):
        bert_classifier(hidden_dim=10, num_heads=3)


def test_missing_keras_hub_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # makes `import keras_hub` fail
    with pytest.raises(ImportError, match=r"pip install keras-accel\[nlp\]"):
        bert_classifier()
