"""Which of a model's own code cannot be told which rows of a batch are padding.

A padded batch is exact because its padding rows reach every loss and metric with weight 0
(`keras_accel.adapter.steps`). Code that computes over the batch without `sample_weight`
sees them as rows like any other, and nothing says so: plain Keras never pads, so its
numbers differ silently. keras-io's examples do this in three places, which are read here
before the first step, from the code alone (nothing runs):

- a model's own `compute_loss` (a distiller's: `alpha * student + (1 - alpha) * teacher`)
  or `compute_metrics` that does not hand `sample_weight` on;
- a layer that adds a loss computed from its inputs: `self.add_loss(...)` in its code (an
  endpoint layer's loss), or an `activity_regularizer` (Keras divides its sum by the batch's
  static row count, padding included).

A custom `train_step`/`test_step` is read by `steps.honours_sample_weight`, and compiled
losses and metrics are probed by `keras_accel.adapter.exactness`. What is found here is
handled as those are (`keras_accel.adapter.batches`): the last partial batch of training is
dropped with a note, and an evaluation that would pad is refused, naming the code.
"""

from __future__ import annotations

import ast
import weakref

from keras_accel.utils import keras_internals, source


def hands_on_sample_weight(function) -> bool:
    """Whether `function`'s source reads a variable named `sample_weight` or passes
    something other than None as `sample_weight=` (one only unpacked and never read does
    not count). A function whose source cannot be read (made at run time) does not."""
    tree = source.tree(function)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Name)
            and node.id == "sample_weight"
            and isinstance(node.ctx, ast.Load)
        ):
            return True
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "sample_weight" and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is None
                ):
                    return True
    return False


def unweighted_code(model, kind: str = "train") -> list[str]:
    """The model's own code that a padded `kind` ("train" or "test") step would run on
    padding rows as on real ones, each as a short description ("Distiller.compute_loss
    does not hand on sample_weight"); empty where there is none."""
    found = []
    for method in ("compute_loss", "compute_metrics"):
        function = _own_method(type(model), method)
        if function is not None and not hands_on_sample_weight(function):
            found.append(
                f"{type(model).__name__}.{method} does not hand on sample_weight (it "
                "counts every row of the batch)"
            )
    adders = []
    for layer in _layers(model):
        if getattr(layer, "activity_regularizer", None) is not None:
            adders.append(f"{layer.name!r} (activity_regularizer)")
        elif _adds_losses(type(layer)):
            adders.append(f"{layer.name!r} ({type(layer).__name__} calls add_loss)")
    if adders:
        shown = ", ".join(adders[:3]) + (f" and {len(adders) - 3} more" if len(adders) > 3 else "")
        found.append(f"layer {shown} adds a loss computed over every row of the batch")
    return found


def _own_method(cls, name: str):
    """`cls`'s `name` where a class of the user's (not Keras's) defines it, else None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            if _is_keras_class(klass):
                return None
            return vars(klass)[name]
    return None


def _layers(model):
    """The model and every layer inside it (Keras's own walk, nested models included)."""
    return keras_internals.flatten_layers(model, include_self=True)


# Per class, whether it adds losses: read once, and held weakly (a class the user drops,
# made in a notebook cell or a search loop, is not kept alive by this).
_ADDS_LOSSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _adds_losses(cls) -> bool:
    """Whether a class of the user's (in its MRO, before Keras's own classes) calls
    `add_loss` in any of its methods: read from the source, once per class."""
    known = _ADDS_LOSSES.get(cls)
    if known is None:
        known = _ADDS_LOSSES[cls] = _reads_add_loss(cls)
    return known


def _reads_add_loss(cls) -> bool:
    for klass in cls.__mro__:
        if _is_keras_class(klass) or klass is object:
            continue
        tree = source.tree(klass)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_loss"
            ):
                return True
    return False


def _is_keras_class(klass) -> bool:
    # Keras's own layers and models add no loss from their inputs but through
    # `activity_regularizer` (read from the instance) and Keras's regularizers.
    module = getattr(klass, "__module__", "") or ""
    return module == "keras" or module.startswith(("keras.", "keras_hub.", "keras_nlp."))


__all__ = ["hands_on_sample_weight", "unweighted_code"]
