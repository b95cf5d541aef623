"""Keras's loss scaling on tf.distribute made uniform, and the global batch's loss reported.

Keras divides each replica's loss by the replica count N (`scale_loss_for_distribution`, in
a loss's reduction), so that the gradients its optimizer sums are the global batch's. Raw
`MirroredStrategy` has two gaps there, both measured:

- a loss whose function returns one number (`ops.mean(...)`) instead of a value per row is
  not divided (Keras divides reduced per-row values only): its gradient counts N times, and
  Keras's loss tracker reports it N times too large;
- a custom step that reports the loss it computes, through `compute_loss` or through a loss
  object it holds (as Keras's guides do), reports it divided by N.

For the duration of an Accelerator call, on the instances only:

- every loss of `compile()` and every Keras loss object the model holds as an attribute
  hands Keras's reduction one value per row: a single number is repeated over the batch's
  rows, which changes no mean, and Keras then divides it like any other;
- `compute_loss` (Keras's own, where a custom step calls it) and those held loss objects
  return the global batch's loss: N times the replica's share, with the share's gradient
  (`share + stop_gradient((N - 1) * share)`). Gradients are Keras's, which the optimizer
  sums (`gradients.py`); what the step reports is what one device reports.

Keras's own steps report their loss through `unscale_loss_for_distribution` already:
`compute_loss` called from one of them is left as it is, and so are the compiled losses. A
loss function that is not a Keras loss object (`keras.losses.mean_squared_error` averaged by
the step itself) is Keras's convention's to get right: as with raw `MirroredStrategy` it is
not divided, and its gradient counts N times (docs/accelerator.md, "Custom steps").
"""

from __future__ import annotations

import contextvars

import keras
import tensorflow as tf
from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import after_build
from keras_accel.utils import keras_internals

# The reductions Keras divides by the replica count (`keras.losses.Loss`'s reduce_values):
# the means. "sum" and "none" are never divided.
DIVIDED = ("sum_over_batch_size", "mean", "mean_with_sample_weight")

# Set while Keras's own step computes its loss (its `_compute_loss`), which it reports
# through `unscale_loss_for_distribution` itself.
_IN_KERAS_STEP: contextvars.ContextVar = contextvars.ContextVar(
    "keras_accel_in_keras_step", default=False
)


def replicas() -> int:
    """The replica count Keras divides losses by: the strategy in scope's, as Keras reads it."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def global_value(share):
    """The global batch's loss from a replica's share of it (Keras's, divided by the replica
    count), with the share's gradient."""
    n = replicas()
    if n == 1:
        return share
    return share + ops.stop_gradient(ops.multiply(share, ops.cast(n - 1, share.dtype)))


def install_uniform_losses(patches: Patches, model) -> None:
    """For the duration of `patches` (see the module docstring): the model's compiled
    losses and the Keras loss objects it holds are divided by the replica count whatever
    they return, and a custom step sees `compute_loss` and those objects give the global
    batch's loss."""
    compiled = keras_internals.compile_loss(model)
    done = {id(loss) for loss in keras.tree.flatten(getattr(model, "loss", None))}
    done.add(id(compiled))  # Keras's own (a Loss too), and the losses given to compile().
    for value in list(vars(model).values()):
        if isinstance(value, keras.losses.Loss) and id(value) not in done:
            done.add(id(value))  # Held twice, changed once.
            patches.set(value, "call", _per_row(value, report=True))
    if compiled is not None:

        def install():
            for loss in keras_internals.compiled_losses(compiled):
                patches.set(loss, "call", _per_row(loss, report=False))

        after_build(patches, compiled, install)
    if not _overrides_compute_loss(model):
        keras_internals.replace_compute_loss(patches, model, _reporting)
    elif compiled is not None:
        _install_override_reporting(patches, model, compiled)


def _overrides_compute_loss(model) -> bool:
    """A class's own `compute_loss` decides its own scaling, as under raw MirroredStrategy
    (Keras's docs override it with an undivided `ops.mean`)."""
    return type(model).compute_loss is not keras.Model.compute_loss


def _reporting(keras_compute_loss, compute_loss):
    """`(Keras's _compute_loss, compute_loss)` -> theirs for this call: Keras's own steps
    get the replica's share; a custom step calling `compute_loss`, the global value."""

    def in_keras_step(*args, **kwargs):
        token = _IN_KERAS_STEP.set(True)
        try:
            return keras_compute_loss(*args, **kwargs)
        finally:
            _IN_KERAS_STEP.reset(token)

    def reported(*args, **kwargs):
        share = compute_loss(*args, **kwargs)
        if _IN_KERAS_STEP.get() or share is None:
            return share
        return global_value(share)

    return in_keras_step, reported


# Inside Keras's own step calling a class's own `compute_loss`: the amounts by which the
# compiled loss was raised to its global value there (None elsewhere).
_RAISED: contextvars.ContextVar = contextvars.ContextVar("keras_accel_raised", default=None)


def _install_override_reporting(patches: Patches, model, compiled) -> None:
    """A class's own `compute_loss` that calls `super().compute_loss(...)` from Keras's
    step (Keras's trainer tests; "update a metric with the loss" in its docs) sees the
    global batch's loss there, as on one device, and Keras's step still gets the
    replica's share back.

    Keras's `compute_loss` gets its value from the compiled loss (`CompileLoss.call`) and
    the added losses (`_aggregate_additional_loss`), each raised to the global value (the
    share's gradient kept, `global_value`) inside Keras's step; whatever the class's
    `compute_loss` returns then has the raise taken off again, so that Keras reports and
    differentiates what it would have without us. A `compute_loss` that returns its own
    loss without calling Keras's keeps Keras's convention (above)."""

    def raising(original):
        def raised_share(*args, **kwargs):
            share = original(*args, **kwargs)
            raised = _RAISED.get()
            if raised is None or share is None or replicas() == 1:
                return share
            value = global_value(share)
            raised.append(value - share)  # stop_gradient((N - 1) * share): no gradient.
            return value

        return raised_share

    def lowering(keras_step_loss):
        def in_keras_step(*args, **kwargs):
            raised = []
            token = _RAISED.set(raised)
            try:
                loss = keras_step_loss(*args, **kwargs)
            finally:
                _RAISED.reset(token)
            if loss is None or not raised:
                return loss
            return loss - ops.cast(sum(raised), loss.dtype)

        return in_keras_step

    # Keras divides both the compiled loss and each added loss (regularizers, `add_loss`)
    # by the replica count on TF: both are raised.
    patches.set(compiled, "call", raising(compiled.call))
    keras_internals.replace_step_and_added_losses(patches, model, lowering, raising)


def _per_row(loss, report: bool):
    """`loss.call` that returns a value per row (a number repeated over the batch's rows:
    the same mean, which Keras's reduction then divides by the replica count), times the
    replica count in value only where `report` and Keras divides it."""
    original = loss.call

    def call(y_true, y_pred):
        values = original(y_true, y_pred)
        if len(getattr(values, "shape", ())) == 0:
            leaves = [leaf for leaf in keras.tree.flatten(y_pred) if len(leaf.shape) > 0]
            if leaves:
                values = ops.broadcast_to(values, ops.shape(leaves[0])[:1])
        if report and loss.reduction in DIVIDED and replicas() > 1:
            mask = keras_internals.keras_mask(values)
            values = global_value(values)
            keras_internals.set_keras_mask(values, mask)
        return values

    return call
