"""Keras's loss scaling on tf.distribute made uniform, and the global batch's loss reported.

Keras divides each replica's loss by the replica count N (`scale_loss_for_distribution`, in
a loss's reduction), so that the gradients its optimizer sums are the global batch's. Raw
`MirroredStrategy` has gaps there, all measured:

- a loss whose function returns one number (`ops.mean(...)`) instead of a value per row is
  not divided (Keras divides reduced per-row values only): its gradient counts N times, and
  Keras's loss tracker reports it N times too large;
- a custom step that reports the loss it computes, through `compute_loss` or through a loss
  object it holds (as Keras's guides do), reports it divided by N;
- a custom `train_step` that computes its loss without Keras's loss objects (keras-io's
  VAE: `ops.mean(ops.sum(keras.losses.binary_crossentropy(...)))`, a function) is not
  divided, and its gradient counts N times;
- a class's own `compute_loss` mixes scales: a Keras loss object in it is divided, an
  `ops.mean` of its own or `ops.sum(self.losses)` is not (Keras's knowledge-distillation
  example reported 8.1 times one device's loss over 8 replicas; one with `ops.mean`
  trains with N times the gradient);
- a loss a layer computes with a Keras loss object and hands to `add_loss` (keras-io's
  endpoint layer pattern) is divided twice, by the loss object and by Keras's sum of the
  added losses: reported and differentiated at 1/N.

For the duration of an Accelerator call, on the instances only:

- every loss of `compile()` and every Keras loss object the model holds as an attribute
  hands Keras's reduction one value per row: a single number is repeated over the batch's
  rows, which changes no mean, and Keras then divides it like any other;
- Keras's own `train_step` keeps Keras's convention: its loss is the replica's share
  (divided by N) and the optimizer sums the replicas' gradients (`gradients.py`);
- a custom `train_step` runs as one device over the replica's rows: `compute_loss`
  (Keras's own or the class's) and the loss objects the model holds return the mean over
  the replica's rows, undivided, gradient included, like a loss the step computes itself;
  the optimizer then averages the replicas' gradients instead of summing them
  (`apply_op`). Equal rows in every replica (a custom step is never padded), so the mean
  of the replicas' means is the global batch's, as one device computes it. A step written
  for TensorFlow's convention, which divides by the replica count itself (its source names
  `num_replicas_in_sync`, `compute_average_loss` or `scale_loss_for_distribution`), keeps
  it: the loss objects return the global value with the share's gradient, and the
  optimizer sums. A custom step that calls `super().train_step(...)` runs Keras's (the
  optimizer sums what Keras's step computed: `STEP_NOTES`);
- a Keras loss object a layer of the model holds (not a nested model) returns the mean over
  the replica's rows, undivided: what it adds with `add_loss` is then divided once, by
  Keras's sum of the added losses, like `add_loss(ops.mean(...))`;
- a class's own `compute_loss` runs as on one device over the replica's rows: inside it
  nothing is divided (the loss objects the model holds, `super().compute_loss(...)`, its
  added losses), and what it returns is taken as the replica's mean and divided once by N,
  here: Keras's step reports and differentiates the replica's share, as with its own
  `compute_loss`. Reported loss and gradient are one device's (for a loss that is a mean
  over the batch's rows, as Keras's losses are).

Keras's own steps report their loss through `unscale_loss_for_distribution` already:
Keras's `compute_loss` called from one of them is left as it is, and so are the compiled
losses. A Keras loss object a class's own `compute_loss` makes anew at each call, rather
than holding it, cannot be reached on the instance and stays divided there.
"""

from __future__ import annotations

import contextvars
import weakref

import keras
import tensorflow as tf
from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import STEP_NOTES, after_build, overrides
from keras_accel.utils import keras_internals, source

# The reductions Keras divides by the replica count (`keras.losses.Loss`'s reduce_values):
# the means. "sum" and "none" are never divided.
DIVIDED = ("sum_over_batch_size", "mean", "mean_with_sample_weight")

# What a custom `train_step`'s source names where it divides its loss by the replica count
# itself, as TensorFlow's guides teach (`tf.nn.compute_average_loss`): it keeps Keras's
# convention.
DIVIDES_ITSELF = ("num_replicas_in_sync", "compute_average_loss", "scale_loss_for_distribution")

# Set while Keras's own step computes its loss (its `_compute_loss`), which it reports
# through `unscale_loss_for_distribution` itself.
_IN_KERAS_STEP: contextvars.ContextVar = contextvars.ContextVar(
    "keras_accel_in_keras_step", default=False
)
# Set while a class's own `compute_loss` runs: nothing is divided inside it.
_IN_OWN_LOSS: contextvars.ContextVar = contextvars.ContextVar(
    "keras_accel_in_own_loss", default=False
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


# Whether a class's `train_step` divides by the replica count itself: read from its source
# once per class, not at every call.
_DIVIDES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def runs_as_one_device(model) -> bool:
    """Whether `model`'s own `train_step` runs as one device over each replica's rows (see
    the module docstring): it overrides Keras's and does not divide by the replica count
    itself."""
    if not overrides(model, "train"):
        return False
    cls = type(model)
    divides = _DIVIDES.get(cls)
    if divides is None:
        divides = _DIVIDES[cls] = bool(source.mentions(cls.train_step, DIVIDES_ITSELF))
    return not divides


def gradients_summed(one_device: bool) -> bool:
    """Whether the optimizer sums the replicas' gradients in the step being traced (Keras's
    convention: each replica's loss is its share), else averages them (a custom step run
    as one device, `one_device`, whose losses are the replica's means): summed where Keras's
    own step computed the loss, as a custom step calling `super().train_step(...)` has it."""
    notes = STEP_NOTES.get()
    return not one_device or notes is None or bool(notes.get("keras_loss"))


def install_uniform_losses(patches: Patches, model, one_device: bool) -> None:
    """For the duration of `patches` (see the module docstring): the model's compiled
    losses and the Keras loss objects it holds are divided by the replica count whatever
    they return, a custom step sees `compute_loss` and those objects give the replica's
    mean (`one_device`, `runs_as_one_device`) or the global batch's loss with the share's
    gradient, its layers' loss objects are not divided, and a class's own `compute_loss`
    is divided once, as a whole."""
    compiled = keras_internals.compile_loss(model)
    done = {id(loss) for loss in keras.tree.flatten(getattr(model, "loss", None))}
    done.add(id(compiled))  # Keras's own (a Loss too), and the losses given to compile().
    for value in list(vars(model).values()):
        if isinstance(value, keras.losses.Loss) and id(value) not in done:
            done.add(id(value))  # Held twice, changed once.
            patches.set(value, "call", _per_row(value, report=True, one_device=one_device))
    for layer in keras_internals.flatten_layers(model, include_self=False):
        if isinstance(layer, keras.Model):
            continue  # Its own compiled losses and held objects are not called in this step.
        for value in list(vars(layer).values()):
            if isinstance(value, keras.losses.Loss) and id(value) not in done:
                done.add(id(value))
                patches.set(value, "call", _undivided(value))
    if compiled is not None:

        def install():
            for loss in keras_internals.compiled_losses(compiled):
                patches.set(loss, "call", _per_row(loss, report=False))

        after_build(patches, compiled, install)
    if not _overrides_compute_loss(model):
        keras_internals.replace_compute_loss(patches, model, _reporting(one_device))
        return
    keras_internals.replace_compute_loss(patches, model, _own_reporting(one_device))
    keras_internals.replace_added_losses(patches, model, _undivided_in_own_loss)
    if compiled is not None:
        patches.set(compiled, "call", _undivided_in_own_loss(compiled.call))


def _overrides_compute_loss(model) -> bool:
    """Whether the model's class has a `compute_loss` of its own (Keras's docs override it
    with an `ops.mean` of their own, a Keras loss object, `super().compute_loss(...)`)."""
    return type(model).compute_loss is not keras.Model.compute_loss


def _in_keras_step(keras_compute_loss):
    """Keras's `_compute_loss` (what its own steps call), marked as such while it runs, and
    noted in the step (`gradients_summed`)."""

    def in_keras_step(*args, **kwargs):
        token = _IN_KERAS_STEP.set(True)
        try:
            return keras_compute_loss(*args, **kwargs)
        finally:
            _IN_KERAS_STEP.reset(token)
            notes = STEP_NOTES.get()
            if notes is not None:
                notes["keras_loss"] = True

    return in_keras_step


def _for_custom_step(share, one_device: bool):
    """What a custom step gets for the replica's `share` of a loss (Keras's, divided by the
    replica count): the replica's mean, with its gradient, where the step runs as one
    device; else the global value, with the share's gradient."""
    if not one_device:
        return global_value(share)
    return ops.multiply(share, ops.cast(replicas(), share.dtype))


def _reporting(one_device: bool):
    """A `make` for `replace_compute_loss`: `(Keras's _compute_loss, compute_loss)` ->
    theirs for this call: Keras's own steps get the replica's share; a custom step calling
    `compute_loss`, `_for_custom_step`'s."""

    def make(keras_compute_loss, compute_loss):
        def reported(*args, **kwargs):
            share = compute_loss(*args, **kwargs)
            if _IN_KERAS_STEP.get() or share is None:
                return share
            return _for_custom_step(share, one_device)

        return _in_keras_step(keras_compute_loss), reported

    return make


def _own_reporting(one_device: bool):
    """As `_reporting`, for a class's own `compute_loss`: it runs with nothing divided
    inside, and what it returns, the replica's mean, is divided once here: the replica's
    share for Keras's steps; for a custom step, the mean as it is where the step runs as
    one device, else the global value with the share's gradient."""

    def make(keras_compute_loss, compute_loss):
        def reported(*args, **kwargs):
            token = _IN_OWN_LOSS.set(True)
            try:
                mean = compute_loss(*args, **kwargs)
            finally:
                _IN_OWN_LOSS.reset(token)
            if mean is None:
                return mean
            mean = ops.convert_to_tensor(mean)  # A Python number, returned as Keras allows.
            if one_device and not _IN_KERAS_STEP.get():
                return mean
            share = ops.divide(mean, ops.cast(replicas(), mean.dtype))
            return share if _IN_KERAS_STEP.get() else global_value(share)

        return _in_keras_step(keras_compute_loss), reported

    return make


def _undivided_in_own_loss(divided):
    """`divided` (a function Keras divides the result of by the replica count: the compiled
    loss, the sum of the added losses) multiplied back while a class's own `compute_loss`
    runs. The compiled loss runs outside that mark: the held loss objects it applies divide
    as Keras's do, and its per-output loss metrics, which multiply back themselves, see
    Keras's values."""

    def call(*args, **kwargs):
        if not _IN_OWN_LOSS.get():
            return divided(*args, **kwargs)
        token = _IN_OWN_LOSS.set(False)
        try:
            value = divided(*args, **kwargs)
        finally:
            _IN_OWN_LOSS.reset(token)
        if value is None:
            return value
        return ops.multiply(value, ops.cast(replicas(), value.dtype))

    return call


def _per_row(loss, report: bool, one_device: bool = False):
    """`loss.call` that returns a value per row (a number repeated over the batch's rows:
    the same mean, which Keras's reduction then divides by the replica count). Where
    `report` (a loss object the model holds) and Keras divides it: inside a class's own
    `compute_loss`, and in a custom step run as one device (`one_device`), the values are
    multiplied by the replica count (Keras's division then gives the replica's mean),
    elsewhere by the replica count in value only (the global value, with the share's
    gradient)."""
    original = loss.call

    def call(y_true, y_pred):
        values = original(y_true, y_pred)
        if len(getattr(values, "shape", ())) == 0:
            leaves = [leaf for leaf in keras.tree.flatten(y_pred) if len(leaf.shape) > 0]
            if leaves:
                values = ops.broadcast_to(values, ops.shape(leaves[0])[:1])
        if report and loss.reduction in DIVIDED:
            mask = keras_internals.keras_mask(values)
            if _IN_OWN_LOSS.get() or (one_device and not _IN_KERAS_STEP.get()):
                values = ops.multiply(values, ops.cast(replicas(), values.dtype))
            else:
                values = global_value(values)
            keras_internals.set_keras_mask(values, mask)
        return values

    return call


def _undivided(loss):
    """`loss.call` whose values Keras's reduction, dividing by the replica count, turns into
    the mean over the replica's rows: multiplied by the replica count, gradient included. A
    single number Keras does not divide is left as it is."""
    original = loss.call

    def call(y_true, y_pred):
        values = original(y_true, y_pred)
        if len(getattr(values, "shape", ())) == 0 or loss.reduction not in DIVIDED:
            return values
        mask = keras_internals.keras_mask(values)
        values = ops.multiply(values, ops.cast(replicas(), values.dtype))
        keras_internals.set_keras_mask(values, mask)
        return values

    return call
