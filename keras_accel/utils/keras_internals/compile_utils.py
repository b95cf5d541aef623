"""Keras's `compile_utils`: the `CompileLoss` and `CompileMetrics` that `keras.Model.compile`
makes (found as that method's globals), what they hold, and the model attributes that hold
them and the loss tracker."""

from __future__ import annotations

from keras_accel.utils.keras_internals.lookup import (
    Internal,
    first,
    globals_of,
    module_at,
    require,
)

_COMPILE_METRICS = first(
    globals_of("keras.Model.compile", "CompileMetrics"),
    lambda: module_at("keras.src.trainers.compile_utils")().CompileMetrics,
)
_COMPILE_LOSS = first(
    globals_of("keras.Model.compile", "CompileLoss"),
    lambda: module_at("keras.src.trainers.compile_utils")().CompileLoss,
)

# Checked by `keras_internals.check()`.
REQUIRED = [
    Internal("CompileMetrics", "build", "masking compiled metrics", _COMPILE_METRICS),
    Internal("CompileLoss", "build", "per-output loss trackers", _COMPILE_LOSS),
    Internal("CompileLoss", "metrics", "per-output loss trackers", _COMPILE_LOSS),
    Internal("CompileMetrics", "metrics", "the compiled metrics", _COMPILE_METRICS),
]
# Instance attributes of a model (set in the trainer's `__init__`), checked by
# `keras_internals.check_model` as part of `trainers.MODEL_ATTRIBUTES`.
COMPILE_ATTRIBUTES = {
    "_compile_loss": "the compiled loss",
    "_compile_metrics": "the compiled metrics",
    "_loss_tracker": "the loss tracker",
}


def compile_loss(model):
    """The model's `CompileLoss` (`model._compile_loss`): None until it is compiled with a
    loss."""
    return require(model, "_compile_loss", COMPILE_ATTRIBUTES["_compile_loss"])


def compile_metrics(model):
    """The model's `CompileMetrics` (`model._compile_metrics`): None until it is compiled
    with metrics."""
    return require(model, "_compile_metrics", COMPILE_ATTRIBUTES["_compile_metrics"])


def compiled_metric_arguments(model) -> tuple:
    """`(metrics, weighted_metrics)` as given to `model.compile` (Keras keeps the objects
    as they are), each None where none was given; `(None, None)` for a model compiled
    without metrics."""
    compiled = compile_metrics(model)
    if compiled is None:
        return None, None
    why = "the metrics a model was compiled with"
    return require(compiled, "_user_metrics", why), require(compiled, "_user_weighted_metrics", why)


def built_compiled_metrics(compiled) -> tuple[list, list]:
    """`(metrics, weighted_metrics)` of a built `CompileMetrics`, one flat list each, as
    Keras updates them (`_flat_metrics`, `_flat_weighted_metrics`; None for an output
    without)."""
    return (
        require(compiled, "_flat_metrics", "the unweighted metrics"),
        require(compiled, "_flat_weighted_metrics", "the weighted metrics"),
    )


def loss_tracker(model):
    """The `Mean` the model averages its loss in (`model._loss_tracker`): None until it is
    compiled."""
    return require(model, "_loss_tracker", COMPILE_ATTRIBUTES["_loss_tracker"])


def compiled_losses(compile_loss) -> list:
    """The loss objects a built `CompileLoss` applies, one per output (`_flat_losses`: each
    `(path, loss, weight, name)`; functions are wrapped as Keras loss objects there)."""
    return [loss for _, loss in compiled_loss_paths(compile_loss)]


def compiled_loss_paths(compile_loss) -> list:
    """`(path, loss)` for each loss a built `CompileLoss` applies: `path` is the output's
    path in the prediction's structure, as `keras.tree.flatten_with_path` gives it (`()` for
    a single output)."""
    flat = require(compile_loss, "_flat_losses", "the compiled losses") or []
    return [(tuple(entry[0]), entry[1]) for entry in flat]
