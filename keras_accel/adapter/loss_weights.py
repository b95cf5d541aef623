"""A padded step's weights as each compiled loss needs them.

The step layer (`keras_accel.adapter.steps`) weights a padded batch's rows `mask * static /
real rows`, shaped to each output's prediction with its last axis reduced: exactly what
Keras's default reduction (a mean over the batch's values) needs for the mean over the real
rows. Three things it cannot know before a loss runs are settled here, per compiled loss, for
the duration of an Accelerator call:

- the rank of the values a loss returns (`install_loss_values`): one reducing more axes than
  the last (one value per row of an image, `keras.losses.Dice(axis=(1, 2, 3))` or a custom
  mean over every axis) gets its values given trailing axes of size 1, which change no sum
  and no count, so that the weights `(rows, 1, 1)` weigh them row by row and never
  broadcast into `(rows, 1, rows)`;
- its reduction (`install_loss_values`): `reduction="sum"` adds the weighted values instead
  of averaging them, so the factor `static / real rows` is taken off again and the loss is
  the sum over the real rows, as plain Keras computes it on the last partial batch;
- a Keras mask on the prediction (`install_loss_masks`), which Keras's mean divides by the
  unmasked steps each replica sees;
- a loss that divides by its weights' sum (`reduction="mean_with_sample_weight"`), where each
  replica or process divides by its own (`install_loss_masks`).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import (
    LOSS_RANKED,
    REPLICATED,
    ROW_COUNT,
    ROW_MASK,
    WEIGHTED_MEANS,
    after_build,
    unscaled,
    with_rank,
)
from keras_accel.utils import keras_internals

# The reductions that divide by the number of values (`keras.losses.Loss`): the ones the
# padding factor and the mask's normalisation are made for, as Keras's `apply_mask` reads
# them. "mean_with_sample_weight" divides by the weights' sum, where both factors cancel.
MEANS = ("sum_over_batch_size", "mean")
WEIGHTED_MEAN = "mean_with_sample_weight"


def install_loss_values(patches: Patches, model, summed_loss_factor: int = 1) -> None:
    """Each compiled loss's values, in a padded step, shaped and scaled for the step's
    weights (see the module docstring); and a sum's values, in every step, times
    `summed_loss_factor` (the runtime's: where the replicas' gradients are averaged, so
    that they add up to the global batch's sum's). Nothing else changes, nor for a loss
    with `reduction=None` or "none", whose values are the user's to read."""
    compiled = keras_internals.compile_loss(model)
    if compiled is None:
        return

    def install():
        # One loss object can serve several outputs (`compile(loss=L)` on a model of two,
        # `[L, L]`): wrapped once, with its outputs' paths in the order Keras calls it.
        paths_of: dict[int, tuple] = {}
        for path, loss in keras_internals.compiled_loss_paths(compiled):
            if getattr(loss, "reduction", None) not in (None, "none"):
                paths_of.setdefault(id(loss), (loss, []))[1].append(path)
        for loss, paths in paths_of.values():
            patches.set(loss, "call", _padded_values(loss, summed_loss_factor, tuple(paths)))

    after_build(patches, compiled, install)


def _padded_values(loss, summed_loss_factor: int, paths: tuple):
    original = loss.call
    summed = loss.reduction not in MEANS + (WEIGHTED_MEAN,)
    weighted_mean = loss.reduction == WEIGHTED_MEAN

    def call(y_true, y_pred):
        values = original(y_true, y_pred)
        if not hasattr(values, "shape"):
            return values
        row_mask, count = ROW_MASK.get(), ROW_COUNT.get()
        padded = row_mask is not None and count is not None
        if padded and LOSS_RANKED.get():
            # The weights are the row mask shaped as the prediction less its last axis.
            target = max(1, len(keras.tree.flatten(y_pred)[0].shape) - 1)
            if 1 <= len(values.shape) < target:
                mask = keras_internals.keras_mask(values)
                while len(values.shape) < target:
                    values = ops.expand_dims(values, -1)
                    mask = None if mask is None else ops.expand_dims(mask, -1)
                if mask is not None:
                    keras_internals.set_keras_mask(values, mask)
        if summed and summed_loss_factor != 1 and not REPLICATED.get():
            # (A replicated step's gradients are not averaged: `steps.REPLICATED`.)
            values = ops.multiply(values, ops.cast(summed_loss_factor, values.dtype))
        if summed and padded:
            # The weights' factor `static / real rows` taken off (as a factor on the
            # values, which the weights multiply).
            static = ops.cast(ops.shape(row_mask)[0], values.dtype)
            values = ops.multiply(values, ops.divide(ops.cast(count(), values.dtype), static))
        factor = _weighted_mean_factor(loss, paths) if weighted_mean else None
        if factor is not None:
            values = ops.multiply(values, ops.cast(factor, values.dtype))
        return values

    return call


def _weighted_mean_factor(loss, paths: tuple):
    """The factor of the output `loss` is being called for (`steps.WEIGHTED_MEANS`), or
    None. Keras calls each output's loss in the order of `paths` (`CompileLoss`'s flat
    losses), so the calls made so far in this loss computation say which output it is."""
    means = WEIGHTED_MEANS.get()
    if means is None:
        return None
    factors, calls = means
    index = calls.get(id(loss), 0)
    calls[id(loss)] = index + 1
    return factors.get(paths[index]) if index < len(paths) else None


def install_loss_masks(patches: Patches, model, row_count: Callable) -> None:
    """Make a loss over masked time steps (a prediction carrying a Keras mask, from
    `Embedding(mask_zero=True)` or `Masking`) the mean over the real rows' unmasked steps of
    the global batch, as one device computes it on the real rows alone.

    Keras divides such a loss by the unmasked steps it sees (`apply_mask`). Two things
    break that here: a padded batch's real rows carry weights `static / real rows` (right
    for a mean over rows, wrong for one over steps), and where each replica or process runs
    its own program each divides by its own steps, so their mean is not the global one. So
    for the duration of the loss the mask is folded into the weights instead: mask (padding
    rows out) times `steps in this batch / unmasked steps` counted over every replica
    (`row_count`, which sums a mask globally and divides by the replica count), the user's
    weights kept. Keras's own reduction of those weights then gives the global mean. The
    prediction's mask is put back after the loss: the metrics read it (their weights are
    the row mask, unscaled, so they are exact with it).

    Only a loss that Keras normalises by its unmasked steps (`sum_over_batch_size`, "mean")
    is: a sum gets the mask alone (and the padding factor, which `install_loss_values`
    takes off), as Keras gives it; "mean_with_sample_weight" divides by the weights' sum,
    mask included, itself.

    Done wherever a prediction carries a mask, one device included: there it computes what
    Keras does, and it spares the user's weights Keras's in-place `sample_weight *= mask`
    on torch (keras/src/losses/loss.py, `apply_mask`), after which Keras's
    `weighted_metrics` read weights rescaled by each batch's unmasked fraction.

    A loss with "mean_with_sample_weight" divides by its weights' sum (the mask's and the
    padding's included), and where each replica or process runs its own program each
    divides by its own: their average is not the global batch's weighted mean where the
    sums differ (unmasked steps, users' weights). So its values are multiplied by this
    replica's sum over the replicas' mean sum (`row_count` of the weights;
    `steps.WEIGHTED_MEANS`): each quotient becomes the replica's share of the global one,
    and their average (the gradients', the logs') that one. 1 where one program sees the
    global batch (JAX, one device, a replicated step)."""
    compiled = keras_internals.compile_loss(model)
    if compiled is None:
        return
    original = compiled.call

    def call(y_true, y_pred, sample_weight=None):
        flat = keras.tree.flatten_with_path(y_pred)
        paths, leaves = [path for path, _ in flat], [leaf for _, leaf in flat]
        masks = [keras_internals.keras_mask(leaf) for leaf in leaves]
        nested = sample_weight is not None and keras.tree.is_nested(sample_weight)
        given = keras.tree.flatten(sample_weight) if nested else [sample_weight] * len(leaves)
        if len(given) != len(leaves):
            return original(y_true, y_pred, sample_weight)
        reductions = _reductions(model, compiled, paths)
        if all(m is None for m in masks):
            return _weighted_means(
                original, (y_true, y_pred, sample_weight), paths, given, reductions, row_count
            )
        row_mask = ROW_MASK.get()
        weights = []
        for path, mask, weight in zip(paths, masks, given):
            if mask is None:
                weights.append(weight)
                continue
            folded = ops.cast(mask, "float32")
            if row_mask is not None:
                folded = ops.multiply(
                    folded, with_rank(ops.cast(row_mask, "float32"), len(folded.shape))
                )
            if reductions.get(tuple(path), MEANS[0]) in MEANS:
                # Back to the user's weights (or the row mask): the mask normalises now.
                weight = unscaled(weight)
                steps = ops.cast(ops.size(folded), "float32")
                unmasked = ops.cast(row_count(folded), "float32")
                folded = ops.multiply(folded, ops.divide_no_nan(steps, unmasked))
            if weight is not None:
                weight, folded = _same_rank(ops.cast(weight, "float32"), folded)
                folded = ops.multiply(folded, weight)
            weights.append(folded)
        for leaf, mask in zip(leaves, masks):
            if mask is not None:
                keras_internals.set_keras_mask(leaf, None)
        try:
            if len(leaves) == 1 and not nested:
                packed = weights[0]
            else:
                packed = keras.tree.pack_sequence_as(y_pred, weights)
            return _weighted_means(
                original, (y_true, y_pred, packed), paths, weights, reductions, row_count
            )
        finally:
            for leaf, mask in zip(leaves, masks):
                if mask is not None:
                    keras_internals.set_keras_mask(leaf, mask)

    patches.set(compiled, "call", call)


def _weighted_means(original, args, paths, weights, reductions, row_count):
    """`original(*args)` with `steps.WEIGHTED_MEANS` set for the outputs whose loss divides
    by its weights' sum (`weights`, as the loss gets them), where the replicas' sums can
    differ (see `install_loss_masks`)."""
    factors = {}
    if not REPLICATED.get():
        for path, weight in zip(paths, weights):
            if weight is None or reductions.get(tuple(path)) != WEIGHTED_MEAN:
                continue
            total = ops.sum(ops.cast(weight, "float32"))
            factors[tuple(path)] = ops.divide_no_nan(total, ops.cast(row_count(weight), "float32"))
    if not factors:
        return original(*args)
    # With the calls counted per loss object: one object may serve several outputs.
    token = WEIGHTED_MEANS.set((factors, {}))
    try:
        return original(*args)
    finally:
        WEIGHTED_MEANS.reset(token)


def _reductions(model, compiled, paths) -> dict:
    """The reduction of each output's loss, by the output's path in the prediction: from
    Keras's built CompileLoss, else (the first trace, before Keras builds it) from the
    losses given to `compile()`, matched to the outputs as Keras matches them (one for
    all, a dict by output name, a list in order)."""
    if compiled.built:
        return {
            path: getattr(loss, "reduction", MEANS[0])
            for path, loss in keras_internals.compiled_loss_paths(compiled)
        }
    given = getattr(model, "loss", None)
    if not keras.tree.is_nested(given):
        return {tuple(path): _reduction(given) for path in paths}
    if isinstance(given, dict):
        names = list(getattr(model, "output_names", None) or [])

        def name(path):
            key = path[-1] if path else None
            if isinstance(key, int) and key < len(names):
                return names[key]
            return key

        return {tuple(path): _reduction(given.get(name(path))) for path in paths}
    flat = keras.tree.flatten(given)
    if len(flat) == len(paths):
        return {tuple(path): _reduction(loss) for path, loss in zip(paths, flat)}
    return {}


def _reduction(loss) -> str:
    # A name or a function is wrapped by Keras with its default reduction.
    return getattr(loss, "reduction", None) or MEANS[0]


def _same_rank(weight, mask):
    """A weight and a mask of one value per step, brought to one rank as Keras does
    (`squeeze_or_expand_to_same_rank`): a `(rows, 1)` weight broadcasts over the steps."""
    if len(weight.shape) == len(mask.shape) + 1 and weight.shape[-1] == 1:
        weight = ops.squeeze(weight, axis=-1)
    elif len(weight.shape) == 1 and len(mask.shape) > 1:
        weight = with_rank(weight, len(mask.shape))
    return weight, mask
