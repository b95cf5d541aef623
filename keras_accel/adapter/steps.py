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
weights or padding rows must be weighted out (padding rows weight 0), and `(x,)` for
prediction. Models that override `train_step` train without padding by default (see
`Accelerator.fit`); see docs/accelerator.md, "Custom steps".
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable

import keras
from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.data.batching import unpack
from keras_accel.utils import keras_internals

STEP_KINDS = ("train", "test", "predict")

# The row mask of the batch being traced (1 real, 0 padding), or None where nothing pads.
ROW_MASK: contextvars.ContextVar = contextvars.ContextVar("keras_accel_row_mask", default=None)
# In a padded train or test step: a function of the mask giving the weight of this batch's
# loss in the epoch average (its real row count), or None.
_ROW_COUNT: contextvars.ContextVar = contextvars.ContextVar("keras_accel_row_count", default=None)


@dataclasses.dataclass(frozen=True)
class StepContract:
    """What one kind of step receives during one Accelerator call.

    Attributes:
        pass_weights: the step gets `(x, y, sample_weight)`, else `(x, y)`.
        user_weighted: the weights are the user's (else they only weight padding out).
        padded: some batch carries padding rows.
        description: the batching, for error messages ("230 rows in batches of 64 ...");
            not compared: two calls that differ only in it run the same compiled step.
    """

    pass_weights: bool
    user_weighted: bool = False
    padded: bool = False
    description: str = dataclasses.field(default="", compare=False)


def overrides(model, kind: str) -> bool:
    """Whether `model`'s class overrides Keras's `{kind}_step`."""
    name = f"{kind}_step"
    return getattr(type(model), name) is not getattr(keras.Model, name)


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
    def step(*args):
        # JAX steps are `step(state, data)`, TF and torch steps `step(data)`.
        *state, data = args
        x, y, sample_weight, row_mask = unpack(data)
        contract = contracts.get(kind) or StepContract(pass_weights=False)
        padded = contract.padded and row_mask is not None
        counted = None
        if padded and y is not None and row_count is not None:
            counted = _once_per_trace(lambda: row_count(row_mask))
            sample_weight = _weighted(sample_weight, row_mask, counted)
        if y is None:
            user = (x,)
        elif contract.pass_weights:
            user = (x, y, sample_weight)
        else:
            user = (x, y)
        if not model.run_eagerly:
            record(kind, user)
        mask_token = ROW_MASK.set(row_mask if padded else None)
        count_token = _ROW_COUNT.set(counted)
        try:
            result = original(*state, user)
        except (ValueError, TypeError) as error:
            # Our padding weights reached a step of the user's that cannot take them.
            if len(user) == 3 and not contract.user_weighted and overrides(model, kind):
                raise ValueError(_padding_message(model, kind, contract, error)) from error
            raise
        finally:
            _ROW_COUNT.reset(count_token)
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


def _weighted(sample_weight, row_mask, counted):
    """A padded batch's weights as the step sees them: the user's (or 1) on real rows, 0 on
    padding, times `static rows / real rows`, so that a loss averaged over the batch
    (Keras's `sum_over_batch_size`) is the mean over its real rows. The real rows are
    counted from the mask, globally (`row_count`): nothing about the data set is needed."""
    mask = ops.cast(row_mask, "float32")
    weights = mask if sample_weight is None else ops.cast(sample_weight, "float32")
    static = ops.cast(ops.shape(mask)[0], "float32")
    scale = ops.divide(static, ops.cast(counted(), "float32"))
    return ops.multiply(weights, scale)


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
            sample_weight = ops.cast(mask, "float32")
        return original(y_true, y_pred, sample_weight=sample_weight)

    return update_state


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


def _unscaled_update(original):
    # In a padded batch the real rows' weights carry static/real rows, so that the loss is
    # the mean over real rows; a weighted metric must see the user's weights.
    def update_state(y_true, y_pred, sample_weight=None):
        count, mask = _ROW_COUNT.get(), ROW_MASK.get()
        if count is not None and mask is not None and sample_weight is not None:
            static = ops.cast(ops.shape(mask)[0], "float32")
            scale = ops.divide(static, ops.cast(count(), "float32"))
            sample_weight = ops.divide(sample_weight, ops.cast(scale, sample_weight.dtype))
        return original(y_true, y_pred, sample_weight=sample_weight)

    return update_state


def install_global_results(
    patches: Patches, model, global_result: Callable, when: Callable | None = None
) -> None:
    """Where each replica runs its own program (TF), make every metric's `result()` inside a
    padded step the result over all replicas' rows: `global_result(metric, original)`.

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
_REDUCING: contextvars.ContextVar = contextvars.ContextVar("keras_accel_reducing", default=False)


def _global_result(metric, global_result: Callable, when: Callable | None = None):
    original = metric.result

    def result():
        if _REDUCING.get() or ((ROW_MASK.get() is None) if when is None else not when()):
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
                patches.set(metric, "update_state", _row_weighted_update(metric.update_state))

    after_build(patches, compile_loss, install)


def _row_weighted_update(original):
    def update_state(values, sample_weight=None):
        count = _ROW_COUNT.get()
        # Keras's built-in steps weight the batch loss by the batch's row count (a scalar);
        # a custom step that averages its losses unweighted keeps doing so.
        if count is not None and sample_weight is not None and _is_scalar(sample_weight):
            sample_weight = count()
        return original(values, sample_weight=sample_weight)

    return update_state


def _is_scalar(value) -> bool:
    # len(), not truthiness: a TensorFlow TensorShape of rank 0 is truthy.
    shape = getattr(value, "shape", ())
    try:
        return len(shape) == 0
    except (TypeError, ValueError):  # A tensor of unknown rank.
        return False
