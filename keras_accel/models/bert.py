"""A keras-hub BERT text classifier, built from a local vocabulary or a local preset; no downloads.

The BERT seed fine-tuned `bert-large-cased` fetched from the internet. keras_accel must also run
where nothing can be fetched (CI, air-gapped TPU hosts), so this builder either makes a small
BERT from a configuration and a vocabulary list, or loads a preset whose files are already on
disk, and otherwise says where it looked instead of trying the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence

from keras_accel.utils.checks import check_positive_int

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_PRESET_CONFIG = "config.json"
_TASK_CONFIG = "task.json"


def _import_keras_hub():
    try:
        import keras_hub
    except ImportError as error:
        if importlib.util.find_spec("keras_hub") is not None:
            raise  # Installed but broken (e.g. a keras-hub too old for this Keras): its error.
        raise ImportError(
            "bert_classifier() needs keras-hub, the optional `nlp` extra of keras-accel. "
            "Install it with: pip install keras-accel[nlp]"
        ) from error
    return keras_hub


def _kagglehub_cache_dir(kaggle_handle: str) -> str:
    """Where kagglehub keeps a downloaded model, e.g. kaggle://keras/bert/keras/<name>/3."""
    root = os.environ.get("KAGGLEHUB_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kagglehub"
    )
    parts = kaggle_handle.removeprefix("kaggle://").split("/")
    return os.path.join(root, "models", *parts)


def _is_preset_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _PRESET_CONFIG))


def _resolve_local_preset(preset: str, known_presets: dict | None = None) -> str:
    """The local directory holding `preset`, or a `FileNotFoundError` saying where it looked.

    `preset` is a directory written by keras-hub's `save_to_preset` (it holds `config.json`),
    or a keras-hub preset name already in the kagglehub cache. Nothing is downloaded.

    Args:
        preset: a directory path or a preset name such as `"bert_tiny_en_uncased"`.
        known_presets: keras-hub's preset table (name -> metadata with `kaggle_handle`).

    Returns:
        The preset directory.

    Example:
        >>> _resolve_local_preset("no_such_bert_preset", {})
        Traceback (most recent call last):
        ...
        FileNotFoundError: BERT preset 'no_such_bert_preset' was not found locally...
    """
    if not isinstance(preset, (str, os.PathLike)) or not str(preset):
        raise ValueError(f"`preset` must be a non-empty path or name. Received: preset={preset!r}")
    preset = os.fspath(preset)
    if preset.startswith("file://"):
        preset = preset.removeprefix("file://")
    elif "://" in preset:
        raise FileNotFoundError(
            f"BERT preset {preset!r} is remote; keras_accel does not download presets. "
            "Download it where the network is reachable (e.g. keras_hub.models."
            "BertTextClassifier.from_preset(...).save_to_preset(directory)) and pass the "
            f"directory. Received: preset={preset!r}"
        )
    directory = os.path.expanduser(preset)
    looked = [os.path.abspath(directory)]
    if os.path.isdir(directory):
        if _is_preset_dir(directory):
            return directory
        raise FileNotFoundError(
            f"Directory {os.path.abspath(directory)!r} is not a keras-hub preset: it has no "
            f"{_PRESET_CONFIG} (a preset directory, as written by `save_to_preset`, holds "
            f"config.json, model.weights.h5, tokenizer.json and assets/). "
            f"Received: preset={preset!r}"
        )
    known_presets = known_presets or {}
    handle = (known_presets.get(preset) or {}).get("kaggle_handle")
    if handle and handle.startswith("kaggle://"):
        cached = _kagglehub_cache_dir(handle)
        looked.append(cached)
        if _is_preset_dir(cached):
            return cached
    hint = (
        f" Known keras-hub BERT preset names: {sorted(known_presets)}."
        if known_presets and preset not in known_presets
        else ""
    )
    raise FileNotFoundError(
        f"BERT preset {preset!r} was not found locally and no download is attempted. "
        f"Looked for a preset directory (with {_PRESET_CONFIG}) at: {looked}.{hint} "
        "Pass the path of a local preset directory, or use `vocabulary=` to build a "
        "small BERT from scratch."
    )


def _check_preset_length(directory: str, sequence_length: int) -> None:
    # Packing past the position table fails deep inside the first batch; say it up front.
    try:
        with open(os.path.join(directory, _PRESET_CONFIG), encoding="utf-8") as f:
            limit = (json.load(f).get("config") or {}).get("max_sequence_length")
    except (OSError, ValueError, AttributeError):
        return  # keras-hub reports unreadable configs itself
    if isinstance(limit, int) and sequence_length > limit:
        raise ValueError(
            f"`sequence_length` exceeds the preset's max_sequence_length={limit} "
            f"({directory}). Received: sequence_length={sequence_length}"
        )


def _saved_num_classes(directory: str) -> int | None:
    """`num_classes` of the BertTextClassifier saved in a preset's task.json, else None."""
    try:
        with open(os.path.join(directory, _TASK_CONFIG), encoding="utf-8") as f:
            task = json.load(f)
    except (OSError, ValueError):
        return None  # a backbone-only preset (the usual published kind) has no task.json
    if not isinstance(task, dict) or task.get("class_name") != "BertTextClassifier":
        return None
    return (task.get("config") or {}).get("num_classes")


def _check_vocabulary(vocabulary) -> list[str] | str:
    if isinstance(vocabulary, (str, os.PathLike)):
        path = os.fspath(vocabulary)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"Vocabulary file {path!r} does not exist. Pass a list of tokens or the path "
                "of a one-token-per-line vocabulary file."
            )
        with open(path, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
        _check_tokens(tokens, source=path)
        return path
    if isinstance(vocabulary, Sequence) and all(isinstance(t, str) for t in vocabulary):
        tokens = list(vocabulary)
        _check_tokens(tokens, source="the vocabulary list")
        return tokens
    raise TypeError(
        "`vocabulary` must be a list of token strings or the path of a vocabulary file. "
        f"Received: vocabulary of type {type(vocabulary).__name__}"
    )


def _check_tokens(tokens: list[str], source: str) -> None:
    missing = [t for t in SPECIAL_TOKENS if t not in tokens]
    if missing:
        raise ValueError(
            f"A BERT vocabulary needs the special tokens {list(SPECIAL_TOKENS)}; {source} "
            f"lacks {missing}. Received: {len(tokens)} tokens, first {tokens[:8]}"
        )
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"{source} has duplicate tokens; each token needs one id.")


def bert_classifier(
    num_classes: int = 2,
    vocabulary: Sequence[str] | str | os.PathLike | None = None,
    preset: str | os.PathLike | None = None,
    *,
    sequence_length: int = 128,
    num_layers: int = 2,
    hidden_dim: int = 64,
    num_heads: int = 2,
    intermediate_dim: int = 128,
    dropout: float = 0.1,
    lowercase: bool = True,
):
    """A keras-hub `BertTextClassifier` with its preprocessor, from local files only.

    Without `preset`, builds a fresh (randomly initialised) `BertBackbone` of the given size,
    a `BertTokenizer` over `vocabulary` and a `BertTextClassifierPreprocessor`; the default
    vocabulary is `keras_accel.data.text.text_vocabulary()`, matching the synthetic text set.
    With `preset` (a local preset directory, or a preset name already in the kagglehub
    cache), loads backbone, weights and tokenizer from it, and the classifier head too when
    the preset was saved from a classifier with the same `num_classes` (otherwise the head is
    new); the size, `dropout` and `lowercase` arguments are then ignored. A preset not on
    disk raises `FileNotFoundError` naming the places looked at; no download is attempted.

    The model takes raw strings and returns logits; keras-hub compiles it with its own
    defaults. Use `compile_seed(model, "bert")` for the seed's Adam(3e-5, epsilon=1e-8).

    Args:
        num_classes: number of labels.
        vocabulary: WordPiece tokens (a list, or a one-per-line file) including
            `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`. Not allowed together with `preset`.
        preset: a local keras-hub preset directory or a cached preset name.
        sequence_length: tokens per example after packing (also the backbone's maximum
            sequence length when building from scratch).
        num_layers: transformer layers.
        hidden_dim: hidden size; must be divisible by `num_heads`.
        num_heads: attention heads.
        intermediate_dim: feed-forward size.
        dropout: dropout rate of the backbone and of the classifier head.
        lowercase: whether the tokenizer lowercases input (from scratch only).

    Returns:
        A `keras_hub.models.BertTextClassifier` with `preprocessor` set.

    Raises:
        ImportError: keras-hub is not installed (`pip install keras-accel[nlp]`).
        FileNotFoundError: `preset` is not available locally.

    Example:
        >>> model = bert_classifier(num_classes=2, sequence_length=16)
        >>> model.predict(["the team scored a goal"], verbose=0).shape
        (1, 2)
    """
    num_classes = check_positive_int("num_classes", num_classes)
    if (
        isinstance(sequence_length, bool)
        or not isinstance(sequence_length, int)
        or (sequence_length < 3)
    ):
        # [CLS] and [SEP] take two of the positions; fewer than 3 leaves no room for text.
        raise ValueError(
            "`sequence_length` must be an integer >= 3. "
            f"Received: sequence_length={sequence_length!r}"
        )
    if preset is not None and vocabulary is not None:
        raise ValueError(
            "Pass either `vocabulary` (build a new BERT) or `preset` (load one), not both. "
            f"Received: vocabulary of type {type(vocabulary).__name__}, preset={preset!r}"
        )
    keras_hub = _import_keras_hub()
    models = keras_hub.models

    if preset is not None:
        directory = _resolve_local_preset(preset, models.BertTextClassifier.presets)
        _check_preset_length(directory, sequence_length)
        preprocessor = models.BertTextClassifierPreprocessor.from_preset(
            directory, sequence_length=sequence_length
        )
        kwargs = {"preprocessor": preprocessor}
        # keras-hub builds a fresh, untrained head whenever `num_classes` is passed; pass it
        # only when the preset holds no classifier head of that size, so a saved fine-tuned
        # classifier comes back with its trained head.
        if _saved_num_classes(directory) != num_classes:
            kwargs["num_classes"] = num_classes
        return models.BertTextClassifier.from_preset(directory, **kwargs)

    if hidden_dim % num_heads:
        raise ValueError(
            "`hidden_dim` must be divisible by `num_heads`. "
            f"Received: hidden_dim={hidden_dim}, num_heads={num_heads}"
        )
    if vocabulary is None:
        from keras_accel.data.text import text_vocabulary

        vocabulary = text_vocabulary()
    vocabulary = _check_vocabulary(vocabulary)
    tokenizer = models.BertTokenizer(vocabulary=vocabulary, lowercase=lowercase)
    preprocessor = models.BertTextClassifierPreprocessor(tokenizer, sequence_length=sequence_length)
    backbone = models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=num_layers,
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        dropout=dropout,
        # The position table only needs the packed length; BERT's 512 would waste weights.
        max_sequence_length=sequence_length,
    )
    return models.BertTextClassifier(
        backbone, num_classes=num_classes, preprocessor=preprocessor, dropout=dropout
    )
