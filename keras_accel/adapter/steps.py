"""The step layer: what a model's train/test/predict step sees during an Accelerator call.

Keras compiles `model.train_step` (under `jax.jit` or `tf.function`), so the Python body of
that method runs only while a new program is traced. A thin wrapper installed on the model
instance for the duration of the call (`keras_accel.adapter.session`) therefore sees every
trace, for free at steady state, on every backend. It:

- turns the Accelerator's batch `(x, y, (sample_weight, row_mask))` into what the model's own
  step expects, exactly as plain Keras would hand it over (the data contract, below);
- counts the trace, with the input shapes and dtypes that caused it (`keras_accel.adapter.guard`);
- weights a padded batch by its own real rows, counted from the row mask (`_weighted`), so
  that training and evaluation are exact without knowing how many rows the data set has;
- publishes the batch's row mask to BatchNormalization (`keras_accel.adapter.batchnorm`), to
  the compiled `metrics=` (which Keras updates without sample weights) and to the loss
  trackers, so that padding rows count nowhere;
- in prediction, returns the row mask beside the outputs, to cut the padding rows after.

The data contract, for built-in and custom steps alike: a step receives `(x, y)` when the
user gave no weights and nothing is padded, `(x, y, sample_weight)` when the user gave
weights or padding rows must be weighted out (padding rows weight 0), and for prediction
or training without targets `x` as it is (one array, or a dict), or `(x,)` where `x` is a
tuple or list of inputs, as Keras's `pack_x_y_sample_weight` packs it. Models that
override `train_step` train without padding by default (see `Accelerator.fit`); see
docs/accelerator.md, "Custom steps".
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable

import keras
from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.unweighted import hands_on_sample_weight
from keras_accel.data.batching import cut_rows, unpack
from keras_accel.utils import keras_internals

STEP_KINDS = ("train", "test", "predict")


class StepValue:
    """A value of the step being traced, as a `contextvars.ContextVar` holds it (`get`,
    `set`, `reset`), that torch's compiler can read too.

    torch.compile cannot trace `ContextVar.get`; a compiled torch step
    (`keras_accel.adapter.backends.torch.compiled`) puts its step's values in `TRACED` for
    the duration of its trace instead (a plain dict, which it can), and every `get` reads
    them there while it is not empty."""

    def __init__(self, name: str, default=None):
        self.name = name
        self.default = default
        self._var: contextvars.ContextVar = contextvars.ContextVar(
            f"keras_accel_{name}", default=default
        )

    def get(self):
        if TRACED.active:
            return getattr(TRACED, self.name, self.default)
        return self._var.get()

    def set(self, value):
        if TRACED.active:  # A token of our own: the value it replaced.
            token = (self.name, getattr(TRACED, self.name, self.default))
            setattr(TRACED, self.name, value)
            return token
        return self._var.set(value)

    def reset(self, token) -> None:
        if isinstance(token, tuple):
            setattr(TRACED, token[0], token[1])
            return
        self._var.reset(token)


class _Traced:
    """The values of the step a torch compilation is tracing, by `StepValue.name`."""

    active = False


TRACED = _Traced()

# The row mask of the batch being traced (1 real, 0 padding), or None where nothing pads.
ROW_MASK = StepValue("row_mask")
# In a padded train or test step: a function of the mask giving the weight of this batch's
# loss in the epoch average (its real row count), or None.
ROW_COUNT = StepValue("row_count")
# In a padded step whose weights are the row mask alone (no user weights), shaped to each
# output's prediction less its last axis (`_loss_ranks`): what `keras_accel.adapter.
# loss_weights` shapes a loss's values to.
LOSS_RANKED = StepValue("loss_ranked", default=False)
# True in the step of a short last batch that every replica runs whole, on all of its real
# rows (`BatchPlan.replicated`, torch's processes): each replica computes what one device
# computes, so nothing in it is reduced across replicas (the gradients' average,
# BatchNormalization's summed moments, users' metrics' gathered rows, the global batch's
# random draws), and only the first replica's metric updates count
# (`keras_accel.adapter.backends.torch`).
REPLICATED = StepValue("replicated", default=False)
# In a train or test step's loss computation: `({output path: factor}, calls)`, a factor for
# each output whose loss divides by its weights' sum (`reduction="mean_with_sample_weight"`)
# that makes this replica's or process's quotient its share of the global one, and the
# calls of each loss object so far (`keras_accel.adapter.loss_weights.install_loss_masks`).
# None elsewhere.
WEIGHTED_MEANS = StepValue("weighted_means")
# A dict of its own for each call of a step (each replica's, each trace's), for what the
# backend needs to know later in the same step about what ran earlier in it (TensorFlow:
# whether Keras's own step computed the loss whose gradients the optimizer applies,
# `keras_accel.adapter.backends.tensorflow.losses`). None outside a step.
STEP_NOTES = StepValue("step_notes")


@dataclasses.dataclass(frozen=True)
class StepContract:
    """What one kind of step receives during one Accelerator call.

    Attributes:
        pass_weights: the step gets `(x, y, sample_weight)`, else `(x, y)`.
        user_weighted: the weights are the user's (else they only weight padding out).
        padded: some batch carries padding rows.
        replicated: a short last batch, marked, reaches every replica whole
            (`BatchPlan.replicated`): its step runs as one device's (`REPLICATED`).
        description: the batching, for error messages ("230 rows in batches of 64 ...");
            not compared: two calls that differ only in it run the same compiled step.
    """

    pass_weights: bool
    user_weighted: bool = False
    padded: bool = False
    replicated: bool = False
    description: str = dataclasses.field(default="", compare=False)


def overrides(model, kind: str) -> bool:
    """Whether `model`'s class overrides Keras's `{kind}_step`."""
    name = f"{kind}_step"
    return getattr(type(model), name) is not getattr(keras.Model, name)


def honours_sample_weight(model, kind: str = "train") -> bool:
    """Whether `model`'s own `{kind}_step` reads `sample_weight` and hands it on, as the
    weighted step of Keras's guide "Customizing what happens in fit()" does
    (`x, y, sample_weight = data` or `keras.utils.unpack_x_y_sample_weight(data)`, then
    `compute_loss(..., sample_weight=sample_weight)`): such a step can be given padding rows
    weighted 0, and is by default. Read from the method's source: a call that passes
    something other than None as `sample_weight=`, or a read of a variable named
    `sample_weight` (one only unpacked and never read does not count). A step whose source
    cannot be read (made at run time) counts as not honouring it, and its last partial
    batch is dropped as before."""
    return hands_on_sample_weight(getattr(type(model), f"{kind}_step"))


def overrides_any_step(model) -> bool:
    return any(overrides(model, kind) for kind in STEP_KINDS)


def install_steps(
    patches: Patches,
    model,
    contracts: dict[str, StepContract],
    record: Callable,
    row_count: Callable | None,
) -> None:
    """Wrap the model's three steps for the duration of `patches`.

    Args:
        contracts: the contract per step kind of this call.
        record: `record(kind, data)`, called at every trace (the recompile guard).
        row_count: `row_count(mask)` -> the global real row count of a padded batch (per
            replica where each replica runs its own program): what its weights are scaled
            by, and the weight of its loss in the epoch's (or evaluation's) average.
    """
    for kind in STEP_KINDS:
        original = getattr(model, f"{kind}_step")
        patches.set(
            model, f"{kind}_step", _wrap(model, kind, original, contracts, record, row_count)
        )


def _wrap(model, kind, original, contracts, record, row_count):
    ranks: dict = {}  # `_loss_ranks` by input shapes: torch runs this every step.

    def step(*args):
        # JAX steps are `step(state, data)`, TF and torch steps `step(data)`.
        *state, data = args
        x, y, sample_weight, row_mask = unpack(data)
        cut = cut_rows(data)
        contract = contracts.get(kind) or StepContract(pass_weights=False)
        if cut is not None:
            # A short last batch padded to the others' shape, marked with its real rows
            # (`BatchPlan.cut_rows`): the model's code sees those alone, as in plain Keras.
            # Replicated, every replica holds them all already (`REPLICATED`).
            x, y, sample_weight = keras.tree.map_structure(
                lambda a: None if a is None else a[:cut], (x, y, sample_weight)
            )
            row_mask = None
        padded = contract.padded and row_mask is not None
        counted = None
        ranked = False
        if padded and y is not None and row_count is not None:
            counted = _once_per_trace(lambda: row_count(row_mask))
            # Without the user's weights the batch's weights are the row mask again.
            given = sample_weight if contract.user_weighted else None
            ranked = given is None
            sample_weight = _weighted(given, row_mask, counted, _loss_ranks(model, x, y, ranks))
        if y is None:
            # As Keras packs it (`keras.utils.pack_x_y_sample_weight`): one array (or a
            # dict of them) as it is, a tuple or list of inputs wrapped, `(x,)`.
            user = (x,) if isinstance(x, (tuple, list)) else x
        elif contract.pass_weights:
            user = (x, y, sample_weight)
        else:
            user = (x, y)
        if not model.run_eagerly:
            record(kind, user)
        mask_token = ROW_MASK.set(row_mask if padded else None)
        count_token = ROW_COUNT.set(counted)
        ranked_token = LOSS_RANKED.set(ranked)
        replicated_token = REPLICATED.set(bool(cut) and contract.replicated)
        notes_token = STEP_NOTES.set({})
        try:
            result = original(*state, user)
        except (ValueError, TypeError) as error:
            # Our padding weights reached a step of the user's that cannot take them.
            three = isinstance(user, tuple) and len(user) == 3
            if three and not contract.user_weighted and overrides(model, kind):
                raise ValueError(_padding_message(model, kind, contract, error)) from error
            raise
        finally:
            STEP_NOTES.reset(notes_token)
            REPLICATED.reset(replicated_token)
            LOSS_RANKED.reset(ranked_token)
            ROW_COUNT.reset(count_token)
            ROW_MASK.reset(mask_token)
        if kind == "predict" and row_mask is not None:
            # The row mask comes back beside the outputs, batch by batch, so that the padding
            # rows can be cut from the predictions without knowing the data's length.
            if state:  # JAX: (outputs, non_trainable_variables).
                outputs, *rest = result
                return ((outputs, row_mask), *rest)
            return result, row_mask
        return result

    return step


def _weighted(sample_weight, row_mask, counted, loss_ranks):
    """A padded batch's weights as the step sees them: the user's (or 1) on real rows, 0 on
    padding, times `static rows / real rows`, so that a loss averaged over the batch
    (Keras's `sum_over_batch_size`) is the mean over its real rows. The real rows are
    counted from the mask, globally (`row_count`): nothing about the data set is needed.

    The weights have the rank of what they weight, so that they broadcast over a loss with
    one value per time step (or pixel): the user's own weights keep theirs (a temporal
    `(rows, steps)` weight gets the mask as `(rows, 1)`); without them, the rank of each
    output's loss (`loss_ranks`, one per output, or one for all), the row mask shaped
    `(rows, 1, ...)`. Keras's own losses and metrics squeeze or broadcast these as they do
    a user's weights of that rank."""
    mask = ops.cast(row_mask, "float32")
    static = ops.cast(ops.shape(mask)[0], "float32")
    scale = ops.divide(static, ops.cast(counted(), "float32"))
    if sample_weight is None:
        weights = keras.tree.map_structure(lambda rank: with_rank(mask, rank), loss_ranks)
    else:
        weights = keras.tree.map_structure(
            lambda w: ops.multiply(ops.cast(w, "float32"), with_rank(mask, len(w.shape))),
            sample_weight,
        )
    return keras.tree.map_structure(lambda w: ops.multiply(w, scale), weights)


def with_rank(row_mask, rank: int):
    """The row mask `(rows,)` as `(rows, 1, ..., 1)` of `rank` dimensions (at least 1)."""
    if rank <= 1:
        return row_mask
    return ops.reshape(row_mask, (-1,) + (1,) * (rank - 1))


def _loss_ranks(model, x, y, cache: dict | None = None):
    """The rank of the values each output's loss has before it is reduced, as Keras's losses
    compute them: one value per row and per position, the last axis of the prediction
    reduced (`(rows, steps)` for a prediction `(rows, steps, classes)`, `(rows,)` for
    `(rows, classes)`). One int for every output alike, else a structure like the
    prediction's (by which Keras's compiled loss finds each output's weights; targets given
    as a dict to a list of outputs are matched by name, the weights by position). A loss
    that reduces more axes than the last gets its values shaped to these weights
    (`keras_accel.adapter.loss_weights`).

    Read from the model's symbolic outputs, else its output spec for `x` (traced once per
    input shape, without running it); where neither is known, from the targets' ranks,
    which is right for sparse targets and one rank too many (squeezed by Keras) for dense
    ones."""
    key = tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(x))
    if cache is not None and key in cache:
        ranks = cache[key]
    else:
        ranks = _output_ranks(model, x)
        if cache is not None:
            cache[key] = ranks
    targets = keras.tree.flatten(y)
    if ranks is None or len(keras.tree.flatten(ranks)) != len(targets):
        ranks = keras.tree.map_structure(lambda leaf: max(1, len(leaf.shape)), y)
    flat = keras.tree.flatten(ranks)
    if len(set(flat)) == 1:
        return flat[0]
    if isinstance(y, dict) and isinstance(ranks, (list, tuple)):
        return list(ranks)
    return keras.tree.pack_sequence_as(y, flat)


def _output_ranks(model, x):
    """Each output's prediction rank less one (at least 1), in the prediction's structure;
    None where the model cannot be traced symbolically."""
    try:
        # Functional and Sequential models have symbolic outputs; a subclassed one has none.
        outputs = model.output if getattr(model, "outputs", None) else None
        if outputs is None:
            outputs = model.compute_output_spec(x)
        return keras.tree.map_structure(lambda leaf: max(1, len(leaf.shape) - 1), outputs)
    except Exception:  # A subclassed model Keras cannot trace symbolically.
        return None


def _once_per_trace(fn: Callable) -> Callable:
    # One value per trace: on TF counting the rows is an all-reduce across replicas.
    cache = []

    def get():
        if not cache:
            cache.append(fn())
        return cache[0]

    return get


def _padding_message(model, kind: str, contract: StepContract, error: Exception) -> str:
    return (
        f"{type(model).__name__}.{kind}_step failed on a batch (x, y, sample_weight): "
        f"{type(error).__name__}: {error}. This "
        f"{'evaluation' if kind == 'test' else 'training'} needs padding rows "
        f"({contract.description}), so every batch carries sample_weight, 0 on the padding "
        "rows, which the step must honour to stay exact. Accept a third element "
        "(`x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)`, and pass "
        "sample_weight to compute_loss and the metrics, as in Keras's guide 'Customizing "
        "what happens in fit()'), or use a batch_size that divides the number of rows and "
        "is a multiple of the replica count, so that nothing is padded."
    )


def install_metric_masks(patches: Patches, model) -> None:
    """Make the compiled `metrics=` (which Keras updates without sample weights) skip padding
    rows: they get the row mask as their weight. `weighted_metrics=` see the padded batch's
    sample weights already, whose padding rows are 0."""
    compiled = keras_internals.compile_metrics(model)
    if compiled is None:
        return

    def install():
        flat, weighted = keras_internals.built_compiled_metrics(compiled)
        # Per output a list of metrics (Keras's MetricsList, which updates each in turn):
        # each its own, so that a metric function returning one value is seen as one.
        for metric in _innermost(flat):
            patches.set(metric, "update_state", _masked_update(metric))
        for metric in weighted:
            if metric is not None:
                patches.set(metric, "update_state", _unscaled_update(metric.update_state))

    after_build(patches, compiled, install)


def after_build(patches: Patches, container, install: Callable) -> None:
    """Run `install` now if `container` (Keras's CompileMetrics or CompileLoss) is built,
    else right after Keras builds it (at the first trace, where Keras defers building)."""
    if container.built:
        install()
        return
    original = container.build

    def build(*args, **kwargs):
        result = original(*args, **kwargs)
        install()
        return result

    patches.set(container, "build", build)


def _innermost(metrics):
    """The metrics that update state themselves, inside Keras's per-output lists."""
    for metric in metrics or []:
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner is not metrics:
            yield from _innermost(inner)
        elif metric is not None:
            yield metric


def _masked_update(metric):
    original = metric.update_state
    fn = keras_internals.wrapped_function(metric)
    if fn is not None and _is_keras(fn):
        fn = None  # Keras's metric functions return one value per row.

    def update_state(y_true, y_pred, sample_weight=None):
        mask = ROW_MASK.get()
        if (
            sample_weight is None
            and mask is not None
            and not _one_value(fn, metric, y_true, y_pred)
        ):
            # Shaped as the metric's values (one per row and position: the prediction's
            # last axis reduced), so that a sequence's values weigh by their row.
            rank = max(1, len(keras.tree.flatten(y_pred)[0].shape) - 1)
            sample_weight = with_rank(ops.cast(mask, "float32"), rank)
        return original(y_true, y_pred, sample_weight=_like_keras_mask(sample_weight, y_pred))

    return update_state


def _like_keras_mask(sample_weight, y_pred):
    """A row's weight `(rows, 1)` broadcast to the shape of the prediction's Keras mask, if it
    has one: Keras multiplies the mask into the weights in place (`sample_weight *=`), which
    torch cannot broadcast into a `(rows, 1)` tensor."""
    if sample_weight is None or keras.tree.is_nested(y_pred):
        return sample_weight
    mask = keras_internals.keras_mask(y_pred)
    if mask is None or len(sample_weight.shape) != len(mask.shape):
        return sample_weight
    return ops.multiply(sample_weight, ops.ones_like(mask, dtype=sample_weight.dtype))


def _one_value(fn, metric, y_true, y_pred) -> bool:
    """Whether a user's metric function returns one value for the batch, which Keras
    averages unweighted (a row mask cannot be broadcast to it). Such a value that the batch
    computes is refused or kept from padding before the call (`keras_accel.adapter.
    exactness`); what gets here is a constant (`lambda y_true, y_pred: 1.0`, in Keras's
    trainer tests), which no padding row changes. Called at trace time only: the extra
    call of a function returning rows is the same computation, merged by the compiler."""
    if fn is None:
        return False
    values = fn(y_true, y_pred, **keras_internals.wrapped_kwargs(metric))
    return not hasattr(values, "shape") or len(values.shape) == 0


def _is_keras(fn) -> bool:
    # Keras's metric and loss functions; not any function in a `keras` module (Keras's own
    # tests define metric functions returning a Python float in `keras.src.trainers`).
    module = getattr(fn, "__module__", None) or ""
    return module.startswith(("keras.src.metrics", "keras.src.losses"))


def unscaled(sample_weight):
    """Inside a padded step, weights without the factor `static / real rows` that makes a
    loss the mean over real rows (the user's weights again, or the row mask)."""
    count, mask = ROW_COUNT.get(), ROW_MASK.get()
    if count is None or mask is None or sample_weight is None:
        return sample_weight
    static = ops.cast(ops.shape(mask)[0], "float32")
    scale = ops.divide(static, ops.cast(count(), "float32"))
    return keras.tree.map_structure(
        lambda w: ops.divide(w, ops.cast(scale, w.dtype)), sample_weight
    )


def _unscaled_update(original):
    # In a padded batch the real rows' weights carry static/real rows, so that the loss is
    # the mean over real rows; a weighted metric must see the user's weights.
    def update_state(y_true, y_pred, sample_weight=None):
        sample_weight = unscaled(sample_weight)
        return original(y_true, y_pred, sample_weight=_like_keras_mask(sample_weight, y_pred))

    return update_state


def install_own_metrics(patches: Patches, model) -> None:
    """Metrics a model's own step updates itself (`self.loss_tracker`, `self.mae_metric` in
    Keras's guide "Customizing what happens in fit()"), given the step's weights in a padded
    batch: they see the weights without the padding factor (the row mask, or the user's
    weights), so that the last batch's rows count once each; and one value for the batch
    (its loss in a `Mean`) with per-row weights, which Keras cannot broadcast, is averaged
    unweighted, as plain Keras averages it without weights. Keras's own metrics (the
    compiled ones, the loss tracker) are handled where they are updated."""
    keras_own = {id(keras_internals.loss_tracker(model))}
    for container in (keras_internals.compile_metrics(model), keras_internals.compile_loss(model)):
        if container is not None:
            # The container and, once built, what it holds (`model.metrics` lists a built
            # CompileLoss's per-output trackers themselves).
            keras_own.add(id(container))
            if container.built:
                keras_own |= {id(leaf) for leaf in _leaf_metrics(container.metrics)}
    for metric in model.metrics:
        if metric is None or id(metric) in keras_own:
            continue
        for leaf in _leaf_metrics([metric]):
            if id(leaf) not in keras_own:
                keras_own.add(id(leaf))
                patches.set(leaf, "update_state", _own_update(leaf))


def _own_update(metric):
    original = metric.update_state
    fn = keras_internals.wrapped_function(metric)
    if fn is not None and _is_keras(fn):
        fn = None  # Keras's metric functions return one value per row.

    def update_state(*args, **kwargs):
        if len(args) == 3:  # update_state(y_true, y_pred, sample_weight), positionally.
            *args, kwargs["sample_weight"] = args
        weight = kwargs.get("sample_weight")
        if ROW_MASK.get() is not None and ROW_COUNT.get() is not None:
            if weight is None:
                kwargs["sample_weight"] = _own_row_weights(fn, metric, args, kwargs)
            elif len(args) == 1 and _is_scalar(args[0]) and not _is_scalar(weight):
                kwargs["sample_weight"] = None
            else:
                kwargs["sample_weight"] = unscaled(weight)
        return original(*args, **kwargs)

    return update_state


def _own_row_weights(fn, metric, args, kwargs):
    """The weights of a step's own update made without any, in a padded batch: the row mask,
    so that padding rows count nowhere, as in the compiled metrics (`_masked_update`).
    Only where the rows are known to be the batch's: `update_state(y_true, y_pred)`, shaped
    as the metric's values; `update_state(values)` whose first axis is the batch's static
    row count. One value for the batch (a loss in a `Mean`, a metric function returning
    one value) is left unweighted, as plain Keras averages it."""
    mask = ops.cast(ROW_MASK.get(), "float32")
    if len(args) == 2 and not ({"y_true", "y_pred", "values"} & set(kwargs)):
        y_true, y_pred = args
        if _one_value(fn, metric, y_true, y_pred):
            return None
        rank = max(1, len(keras.tree.flatten(y_pred)[0].shape) - 1)
        return _like_keras_mask(with_rank(mask, rank), y_pred)
    if len(args) == 1 and not _is_scalar(args[0]) and hasattr(args[0], "shape"):
        rows = args[0].shape[0]
        if rows is not None and rows == mask.shape[0]:
            return mask
    return None


def install_global_results(
    patches: Patches, model, global_result: Callable, when: Callable | None = None
) -> None:
    """Where each replica runs its own program (TF), make every metric's `result()` inside a
    padded (or replicated) step the result over all replicas' rows: `global_result(metric,
    original)`.

    Keras reports a step's logs as the mean of the replicas' own results, which is the
    global result only when every replica holds as many real rows as the others; a padded
    batch puts its padding on the last replicas. `when()` says where results are global
    instead (default: inside a padded step); on torch, whose logs are each process's own,
    inside every step.
    """
    done: set[int] = set()

    def install(metrics):
        for metric in _leaf_metrics(metrics):
            if id(metric) not in done:
                done.add(id(metric))
                patches.set(metric, "result", _global_result(metric, global_result, when))

    install(model.metrics)
    for container in (keras_internals.compile_metrics(model), keras_internals.compile_loss(model)):
        if container is not None:
            after_build(patches, container, lambda c=container: install(c.metrics))


def results_of_state(metrics, reduce_values: Callable, results: Callable):
    """`results()` with the state of every metric in `metrics` (and their inner ones)
    replaced by `reduce_values(variables)` for the duration, all at once, so that one
    reduction serves every metric's `result()` (which `install_global_results`' wrappers then
    leave as it is)."""
    variables, seen = [], set()
    for metric in _leaf_metrics(metrics):
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    values = reduce_values(variables)

    def in_reduced_state():
        with keras.StatelessScope(state_mapping=list(zip(variables, values))):
            return results()

    return unreduced(in_reduced_state)


def unreduced(results: Callable):
    """`results()` with every metric's `result()` this process's own (no reduction)."""
    token = _REDUCING.set(True)
    try:
        return results()
    finally:
        _REDUCING.reset(token)


def _leaf_metrics(metrics):
    for metric in metrics or []:
        if metric is None:
            continue
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner is not metrics:
            yield from _leaf_metrics(inner)
        if hasattr(metric, "variables") and callable(getattr(metric, "result", None)):
            yield metric


# Set while a global result is computed: a container's result (Keras's CompileMetrics) reads
# its inner metrics' results from the state already reduced, which must not be reduced again.
# A StepValue: a compiled torch step traces the reduction (`backends.torch.compiled`).
_REDUCING = StepValue("reducing", default=False)


def _global_result(metric, global_result: Callable, when: Callable | None = None):
    original = metric.result

    def result():
        # Global inside a padded step, and inside a replicated one, whose replicas' own
        # results differ (the first holds the batch's rows: `REPLICATED`).
        padded = ROW_MASK.get() is not None or REPLICATED.get()
        if _REDUCING.get() or (not padded if when is None else not when()):
            return original()
        token = _REDUCING.set(True)
        try:
            return global_result(metric, original)
        finally:
            _REDUCING.reset(token)

    return result


def install_loss_trackers(patches: Patches, model) -> None:
    """In a padded step, weight each batch's loss in the epoch (or evaluation) average by
    its real row count, as plain Keras does (Keras weights by the batch's row count, which
    here is the static size, padding included)."""
    tracker = keras_internals.loss_tracker(model)
    patches.set(tracker, "update_state", _row_weighted_update(tracker.update_state))
    compile_loss = keras_internals.compile_loss(model)
    if compile_loss is None:
        return

    def install():
        # Multi-output models: one tracker per output loss.
        for metric in compile_loss.metrics:
            if metric is not None:
                update = _row_weighted_update(metric.update_state, per_output=True)
                patches.set(metric, "update_state", update)

    after_build(patches, compile_loss, install)


def _row_weighted_update(original, per_output: bool = False):
    def update_state(values, sample_weight=None):
        count = ROW_COUNT.get()
        # Keras's built-in steps weight the batch loss by the batch's row count (a scalar);
        # a custom step that averages its losses unweighted keeps doing so. Keras's own
        # per-output trackers (`per_output`) get the row count as the prediction's static
        # first dimension, None where the traced step does not know it (TensorFlow's
        # evaluation): they are weighted by the real rows all the same.
        unknown = per_output and sample_weight is None
        if count is not None and (
            unknown or (sample_weight is not None and _is_scalar(sample_weight))
        ):
            return _final_weight(original, values, count())
        elif count is not None and sample_weight is not None and _is_scalar(values):
            # A step of the user's handing the batch's weights on with its one loss value
            # (Keras's JAX guide): Keras cannot broadcast them; without weights, as plain
            # Keras gets them, each batch's loss counts once.
            sample_weight = None
        return original(values, sample_weight=sample_weight)

    return update_state


def _final_weight(original, values, weight):
    """`original(values, sample_weight=weight)` where `weight` is the batch's real row
    count already, which no wrapper beneath may rescale.

    Once Keras's CompileLoss is built (by an earlier call: `fit` before `evaluate`), its
    per-output trackers are in `model.metrics`, so `install_own_metrics` has wrapped them
    too, beneath this wrapper: it takes a padded step's weights for the step's (scaled by
    `static / real rows`) and divides them by that factor, so that the last batch counted
    `real rows ** 2 / static` (0.390625 for 0.625 per replica, 8 replicas, 5 real rows of
    8), and the per-output losses no longer added up to `loss`. The row count is not
    published while the weight is handed on: such a wrapper leaves it as it is."""
    token = ROW_COUNT.set(None)
    try:
        return original(values, sample_weight=weight)
    finally:
        ROW_COUNT.reset(token)


def _is_scalar(value) -> bool:
    # len(), not truthiness: a TensorFlow TensorShape of rank 0 is truthy.
    shape = getattr(value, "shape", ())
    try:
        return len(shape) == 0
    except (TypeError, ValueError):  # A tensor of unknown rank.
        return False
