"""Fine-tune a keras-hub Gemma causal LM with LoRA, fully sharded, then generate.

    KERAS_BACKEND=jax python examples/gemma_lora.py --virtual-devices 8
    KERAS_BACKEND=jax python examples/gemma_lora.py --preset ./gemma_2b_en   # real weights

`Accelerator(strategy="fsdp", layout_map=GemmaCausalLM)`: every variable (the frozen
weights, the LoRA adapters, Adam's slots) is split over the devices by Gemma's own layout
map plus the data axis (docs/sharding.md), and each device feeds its share of every batch.
The model trains on raw strings through its preprocessor, then `generate()` completes a
prompt. Nothing is downloaded: by default a small Gemma is built from a configuration, with
a SentencePiece tokenizer trained here on the text set made here (sentences about a few
animals, so the loss can fall within a few epochs). `--preset DIR` loads real weights and
their tokenizer from a local keras-hub preset directory; when none is there it says where it
looked. JAX only: Keras 3 has no tf.distribute equivalent of fsdp.

Needs the `jax` and `nlp` extras (keras-hub, with SentencePiece), beyond README's first
set-up command: pip install -c constraints.txt -e ".[jax,nlp]" (or its second, `all`).
"""

from __future__ import annotations

import argparse
import io
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ANIMALS = ["cat", "dog", "fox", "owl", "bee"]
DOINGS = {
    "cat": "sleeps on the warm mat",
    "dog": "runs after the red ball",
    "fox": "hides in the dark wood",
    "owl": "watches the quiet night",
    "bee": "visits the yellow flower",
}


def sentences(count: int) -> list[str]:
    """`count` sentences, each saying what one animal does."""
    return [f"the {a} {DOINGS[a]}" for a in (ANIMALS[i % len(ANIMALS)] for i in range(count))]


def tokenizer_proto(texts: list[str], vocabulary_size: int) -> bytes:
    """A word-level SentencePiece model of `texts`, with Gemma's special pieces (the ids
    keras-hub's GemmaTokenizer expects: <pad> 0, <bos> 1, <eos> 2, <unk> 3)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocabulary_size,
        model_type="WORD",
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        bos_piece="<bos>",
        eos_piece="<eos>",
        unk_piece="<unk>",
        minloglevel=2,
    )
    return model.getvalue()


def small_gemma(texts: list[str], sequence_length: int):
    import keras_hub

    words = {w for text in texts for w in text.split()}
    tokenizer = keras_hub.models.GemmaTokenizer(proto=tokenizer_proto(texts, len(words) + 4))
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
        tokenizer, sequence_length=sequence_length
    )
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-2)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=12)
    parser.add_argument("--prompt", default="the owl")
    parser.add_argument("--preset", default=None, help="a local keras-hub Gemma preset")
    parser.add_argument("--virtual-devices", type=int, default=None,
                        help="split the CPU into N devices first")  # fmt: skip
    args = parser.parse_args()

    import keras_accel

    if args.virtual_devices:
        keras_accel.configure_virtual_cpu_devices(args.virtual_devices)
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit(
            f"gemma_lora.py trains under strategy='fsdp', which needs KERAS_BACKEND=jax. "
            f"Received: KERAS_BACKEND={keras.backend.backend()}."
        )
    import importlib.util

    if importlib.util.find_spec("keras_hub") is None:
        raise SystemExit(
            "gemma_lora.py needs keras-hub, keras-accel's `nlp` extra: pip install -c "
            'constraints.txt -e ".[jax,nlp]" from the repository root.'
        )
    import keras_hub

    from keras_accel import Accelerator

    acc = Accelerator(strategy="fsdp", layout_map=keras_hub.models.GemmaCausalLM, seed=0)
    texts = sentences(args.samples)
    with acc.scope():
        if args.preset:
            if not os.path.isdir(args.preset):
                raise SystemExit(
                    f"gemma_lora.py: no keras-hub preset directory at {args.preset!r} "
                    f"(looked in {os.path.abspath(args.preset)}). Pass a directory holding "
                    "a Gemma preset's config.json, model.weights.h5 and tokenizer."
                )
            model = keras_hub.models.GemmaCausalLM.from_preset(
                args.preset, sequence_length=args.sequence_length
            )
        else:
            model = small_gemma(texts, args.sequence_length)
        model.backbone.enable_lora(rank=args.lora_rank)
        model.compile(
            optimizer=keras.optimizers.Adam(args.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
        )
    trainable = sum(int(v.numpy().size) for v in model.trainable_weights)
    print(f"backend:  jax, fsdp over {acc.num_replicas} device(s), mesh {acc.mesh_shape}")
    print(
        f"model:    GemmaCausalLM, {model.count_params():,} parameters, {trainable:,} "
        f"trainable (LoRA rank {args.lora_rank})"
    )
    embedding = model.backbone.get_layer("token_embedding").embeddings
    # Over a mesh the weight's sharding names its layout (`spec`); on one device, JAX holds
    # it whole there (a SingleDeviceSharding, which has no spec).
    sharding = embedding.value.sharding
    placed = getattr(sharding, "spec", None) or f"whole on {len(sharding.device_set)} device"
    print(f"layout:   token_embedding {tuple(embedding.shape)} {placed}")
    history = acc.fit(model, texts, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    for epoch, (loss, accuracy) in enumerate(
        zip(history.history["loss"], history.history["accuracy"]), 1
    ):
        print(f"epoch {epoch}: loss {loss:.4f}, accuracy {accuracy:.4f}")
    # Outside the scope: keras-hub then leaves the prompt whole (inside it, it would split
    # the one prompt over the data axis), and XLA gathers the sharded weights as it runs.
    completion = model.generate(args.prompt, max_length=args.sequence_length)
    print(f"generate: {args.prompt!r} -> {completion!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
