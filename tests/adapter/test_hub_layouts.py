"""keras-hub's own layout maps, by naming the model class: `layout_map=GemmaCausalLM` lays a
Gemma out as keras-hub's `GemmaBackbone.get_layout_map` says, under `model_parallel` and
`fsdp`, and trains as one device does. Tiny models from configurations: nothing downloaded."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.adapter.sharding import fully_sharded_axes
from tests.helpers import FEW_REPLICAS

keras_hub = pytest.importorskip("keras_hub")

ROWS, LENGTH, VOCABULARY = 37, 6, 64


def _backbone():
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
    )


def _classifier():
    """The backbone's first position, classified: a model on top of a keras-hub backbone."""
    keras.utils.set_random_seed(0)
    backbone = _backbone()
    inputs = {
        "token_ids": keras.Input((LENGTH,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((LENGTH,), dtype="int32", name="padding_mask"),
    }
    features = backbone(inputs)[:, 0, :]
    outputs = keras.layers.Dense(3, "softmax", name="head")(features)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model, backbone


def _data():
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, VOCABULARY, (ROWS, LENGTH)).astype("int32"),
        "padding_mask": np.ones((ROWS, LENGTH), "int32"),
    }
    return x, (x["token_ids"][:, 0] % 3).astype("int64")


def _specs(layer) -> dict:
    return {v.path: tuple(v.value.sharding.spec) for v in layer.weights}


@pytest.mark.parametrize("strategy, mesh_shape", [("model_parallel", (2, 4)), ("fsdp", (4, 2))])
def test_a_keras_hub_class_lays_its_backbone_out_by_its_own_map(backend, strategy, mesh_shape):
    if backend != "jax":
        with pytest.raises(ValueError, match=f"strategy='{strategy}' needs the JAX backend"):
            Accelerator(strategy=strategy, layout_map=keras_hub.models.GemmaCausalLM)
        return
    acc = Accelerator(
        strategy=strategy,
        mesh_shape=mesh_shape,
        layout_map=keras_hub.models.GemmaCausalLM,  # A task: its backbone's map.
        seed=0,
    )
    with acc.scope():
        model, backbone = _classifier()
    # What keras-hub's own map gives each variable, on the same mesh.
    shipped = keras_hub.models.GemmaBackbone.get_layout_map(acc.distribution.device_mesh)
    data_axis = mesh_shape[0] if strategy == "fsdp" else 1  # fsdp adds "batch" where free.
    for variable in backbone.weights:
        entry = shipped[variable.path]
        axes = tuple(entry.axes) if entry is not None else (None,) * len(variable.shape)
        want = fully_sharded_axes(variable.shape, axes, "batch", data_axis)
        assert tuple(variable.value.sharding.spec) == want, variable.path
    embedding = _specs(backbone.get_layer("token_embedding"))
    assert embedding["token_embedding/embeddings"] == ("model", "batch")
    twin, _ = _classifier()  # One device, the same initial weights.
    twin.set_weights(model.get_weights())
    x, y = _data()
    history = acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    want = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], want.history["loss"], rtol=1e-5)
    for got, expected in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_shipped_map_left_unused_is_named_once(backend, capsys):
    if backend != "jax":
        pytest.skip(
            "layout maps are keras.distribution's (JAX); TF refuses both strategies, tested above"
        )
    acc = Accelerator(strategy="model_parallel", mesh_shape=(2, 4), seed=0)
    with acc.scope():
        backbone = _backbone()
    x, _ = _data()
    for _ in range(2):
        acc.predict(backbone, x, batch_size=8, verbose=0)
    out = capsys.readouterr().out
    assert out.count("GemmaBackbone ships a layout map, unused here") == 1, out
    assert "layout_map=keras_hub.models.GemmaBackbone)" in out


def test_a_class_without_a_map_is_refused_by_name(backend):
    if backend != "jax":
        pytest.skip(
            "layout maps are keras.distribution's (JAX); TF refuses both strategies, tested above"
        )
    with pytest.raises(ValueError, match="keras-hub model class .* Received: BertBackbone"):
        Accelerator(strategy="model_parallel", layout_map=keras_hub.models.BertBackbone)
    with pytest.raises(ValueError, match=r"LayoutMap, or a keras-hub .* Received: \{'a': 1\}"):
        Accelerator(strategy="fsdp", layout_map={"a": 1})


def _preprocessor(texts):
    """A GemmaCausalLMPreprocessor over a word-level tokenizer trained on `texts`."""
    import io

    import sentencepiece

    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=proto, vocab_size=16, model_type="WORD",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="<pad>", bos_piece="<bos>",
        eos_piece="<eos>", unk_piece="<unk>", minloglevel=2,
    )  # fmt: skip
    tokenizer = keras_hub.models.GemmaTokenizer(proto=proto.getvalue())
    return keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=8)


def _causal_lm(preprocessor):
    """A tiny GemmaCausalLM over `preprocessor`. No `set_random_seed` here: TensorFlow's
    global seed, set after a SentencePiece tokenizer exists, loses its resource."""
    backbone = _backbone_of(preprocessor.tokenizer.vocabulary_size())
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def _backbone_of(vocabulary_size):
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=vocabulary_size, num_layers=1, num_query_heads=2,
        num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
    )  # fmt: skip


def test_a_causal_lm_trains_on_raw_strings_as_keras_hub_does_on_one_device(backend):
    """`acc.fit(causal_lm, texts)`: no y, as keras-hub's own fit takes it; the preprocessor
    makes the targets and the token padding mask, and both are honoured (loss and the
    weighted accuracy equal one device's, with 21 sentences of unequal lengths in batches of
    8, the last one padded)."""
    texts = [
        "the cat sleeps",
        "the dog runs after the ball",
        "a fox hides",
        "the owl watches the night",
        "bees visit flowers",
    ] * 5
    texts = texts[:21]
    strategy = {"strategy": "fsdp"} if backend == "jax" else {"devices": FEW_REPLICAS}
    acc = Accelerator(seed=0, **strategy)
    preprocessor = _preprocessor(texts)
    with acc.scope():
        model = _causal_lm(preprocessor)
    twin = _causal_lm(preprocessor)
    twin.set_weights(model.get_weights())
    validation = texts[:5]  # One batch of 5: padded to 8 (over the replicas) on JAX.
    history = acc.fit(
        model, texts, batch_size=8, epochs=2, shuffle=False, verbose=0,
        validation_data=(validation,),
    )  # fmt: skip
    want = twin.fit(
        texts, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(validation,)
    )
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(history.history[key], want.history[key], rtol=1e-5, err_msg=key)
    evaluated = acc.evaluate(model, texts, batch_size=8, verbose=0, return_dict=True)
    assert evaluated == pytest.approx(
        twin.evaluate(texts, batch_size=8, verbose=0, return_dict=True), rel=1e-5
    )
    for got, expected in zip(model.get_weights(), twin.get_weights()):
        np.testing.assert_allclose(got, expected, atol=1e-5)
