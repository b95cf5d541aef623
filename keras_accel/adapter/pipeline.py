"""keras-hub's pipeline models (every task: BertTextClassifier, CausalLM, ...), whose `fit`
runs their preprocessor on raw inputs: found by what they do rather than by import, so that
keras_accel never imports keras-hub itself. Used by `Accelerator.fit` and by `acc.loop`."""

from __future__ import annotations

import keras

from keras_accel.data import sources


def is_pipeline(model) -> bool:
    """Whether `model` is a keras-hub task: it preprocesses samples and has a fit of its own."""
    return callable(getattr(model, "preprocess_samples", None)) and (
        type(model).fit is not keras.Model.fit
    )


def preprocessor(model):
    """`preprocess_samples(x, y, sample_weight)` of a keras-hub task with a preprocessor."""
    if not is_pipeline(model):
        return None
    if hasattr(model, "preprocessor") and model.preprocessor is None:
        return None
    return model.preprocess_samples


def hub_layout_map(model_class, mesh, model_axis: str = "model", data_axis: str = "batch"):
    """The `LayoutMap` a keras-hub model class ships for `mesh` (a backbone's own
    `get_layout_map`, or its task's backbone's: `GemmaCausalLM` -> `GemmaBackbone`), or None
    when it ships none. Found by what the class has, as above."""
    owner = model_class if isinstance(model_class, type) else type(model_class)
    get = getattr(owner, "get_layout_map", None)
    if get is None:
        backbone = getattr(owner, "backbone_cls", None)
        get = getattr(backbone, "get_layout_map", None)
    if get is None:
        return None
    return get(mesh, model_parallel_dim_name=model_axis, data_parallel_dim_name=data_axis)


def with_made_targets(batches, preprocess):
    """`batches`, marked with what `preprocess` (a keras-hub task's) adds to them, read from
    its first batch: a causal LM's preprocessor makes the targets (the next tokens) and the
    weights (the token padding mask) from x alone, so `fit(texts)` trains on both, as
    keras-hub's own fit does."""
    if preprocess is None or (batches.has_targets and batches.weighted):
        return batches
    x, y, sample_weight, _ = sources.sample_batch(batches)
    _, made_y, made_weights = sources.standardize_element(preprocess(x, y, sample_weight))
    if made_y is not None and not batches.has_targets:
        batches.has_targets = True
    if made_weights is not None and not batches.weighted:
        batches.weighted = True
    return batches
