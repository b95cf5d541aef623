"""Reductions across replicas inside a step: sums, metrics' global results, users' metrics
updated on the global batch, and the logs of a multi-worker step."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_accel.adapter.backends.global_rows import UserMetricPatches
from keras_accel.adapter.steps import REPLICATED, ROW_MASK
from keras_accel.utils import keras_internals, library_internals


def global_result(metric, result):
    """`metric`'s result over every replica's rows, from inside a replica: its variables
    reduced as a cross-replica read would reduce them (Keras's are SUM, on read)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return result()
    with keras.StatelessScope(state_mapping=list(zip(metric.variables, _read(metric)))):
        return result()


_OPERATIONS = {
    tf.VariableAggregation.SUM: tf.distribute.ReduceOp.SUM,
    tf.VariableAggregation.MEAN: tf.distribute.ReduceOp.MEAN,
}


def _read(metric) -> list:
    """`metric`'s variables as a cross-replica read gives them, from inside a replica."""
    context = tf.distribute.get_replica_context()
    operations = _OPERATIONS
    values = []
    grouped: dict = {}  # (operation, dtype) -> indices of the variables it reduces
    for i, variable in enumerate(metric.variables):
        # One copy per replica (a metric built in the strategy's scope); a variable built
        # outside it is one copy every replica updates: its value is the value.
        per_replica = _per_replica(variable)
        operation = operations.get(variable.value.aggregation) if per_replica else None
        # tf.identity places the read on this replica's device: a read of a metric's
        # variable carries none under MultiWorkerMirroredStrategy, and its collective then
        # fails ("destinations can not be empty").
        values.append(tf.identity(tf.convert_to_tensor(variable.value)))
        if operation is not None:
            grouped.setdefault((operation, values[-1].dtype), []).append(i)
    # One all-reduce per operation and dtype: TF packs a list of one dtype into one
    # collective per replica (it concatenates them), where one call per variable is one
    # collective each (a metric's total and count: two), and every collective is a point
    # all 8 CPU replicas meet at (docs/benchmarks.md).
    for (operation, _), indices in grouped.items():
        reduced = reduce_undifferentiated(context, operation, [values[i] for i in indices])
        for i, value in zip(indices, reduced):
            values[i] = value
    return values


def _per_replica(variable) -> bool:
    return isinstance(variable.value, tf.distribute.DistributedValues)


class GatheredMetrics(UserMetricPatches):
    """Users' metrics updated on the global batch, for one call (or one trace): `install`
    before the padding masks (which then wrap the gather: its weights are the row mask)
    and after `install_global_results` (whose result wrapper this one wraps).

    A user's metric may keep a state no sum of the replicas' states gives (a running
    maximum). Inside a replica its `update_state` is given every replica's rows (its
    tensors all-gathered along axis 0, in replica order: the global batch, padding weights
    included), starting from the state a cross-replica read gives, and leaves the result
    where a cross-replica read finds it: a SUM variable in the first replica (0 in the
    others), a MEAN, ONLY_FIRST_REPLICA or NONE variable in every replica. Every read then
    gives the global state: Keras's logs (its `result()` inside a step reads as a
    cross-replica read would), `evaluate`, the custom loop's `results()`, a read after the
    call. Cost per update: one all-gather per input tensor and one
    all-reduce of the metric's state.
    """

    def patch(self, patches, metric) -> None:
        patches.set(metric, "update_state", _gathered_update(metric, metric.update_state))
        patches.set(metric, "result", _global_read(metric, metric.result))


def install_gathered_metrics(patches, model) -> None:
    """`GatheredMetrics` on `model`'s metrics (the compiled ones once Keras builds them)."""
    GatheredMetrics().install_on_model(patches, model)


def _replicated():
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def _gathered_update(metric, original):
    def update_state(*args, **kwargs):
        context = _replicated()
        if context is None:
            return original(*args, **kwargs)
        for leaf in tf.nest.flatten((args, kwargs)):
            if tf.is_tensor(leaf) and leaf.shape.rank == 0:
                raise ValueError(
                    f"The metric {metric.name!r} ({type(metric).__name__}) was updated with "
                    f"a scalar tensor across {context.num_replicas_in_sync} replicas. A "
                    "metric that is not Keras's own is updated on the global batch's rows, "
                    "gathered from every replica, which a value of one replica's rows alone "
                    "(a batch loss, a mean) cannot give. Pass per-row values (targets, "
                    "predictions, weights with the batch on axis 0), or track a batch value "
                    "with keras.metrics.Mean, whose sums the replicas add up exactly."
                )
        if not REPLICATED.get():  # A replicated step's rows are the global batch's already.
            args, kwargs = tf.nest.map_structure(
                lambda t: context.all_gather(t, axis=0) if tf.is_tensor(t) else t, (args, kwargs)
            )
        variables = list(metric.variables)
        state = _read(metric)
        with keras.StatelessScope(state_mapping=list(zip(variables, state))) as scope:
            original(*args, **kwargs)
            updated = [scope.get_current_value(v) for v in variables]
        replica = context.replica_id_in_sync_group
        first = tf.equal(replica, 0)
        for variable, old, new in zip(variables, state, updated):
            new = old if new is None else tf.convert_to_tensor(new, old.dtype)
            if not _per_replica(variable):
                # One copy that every replica would write: the first replica writes it.
                _assign_in_first(variable, new, replica)
                continue
            if variable.value.aggregation == tf.VariableAggregation.SUM:
                new = tf.where(first, new, tf.zeros_like(new))
            variable.assign(new)

    return update_state


def _assign_in_first(variable, value, replica) -> None:
    static = tf.get_static_value(replica)
    if static is not None:  # MirroredStrategy: each replica's program knows its index.
        if int(static) == 0:
            variable.assign(value)
        return

    def assign():
        variable.assign(value)
        return tf.constant(True)

    tf.cond(tf.equal(replica, 0), assign, lambda: tf.constant(False))


def _global_read(metric, original):
    """Keras reads a step's logs inside each replica, from the replica's own state: read it
    as a cross-replica read would. Installed over `install_global_results`' wrapper, which
    does so itself in a padded step (where the row mask is set)."""

    def result():
        if _replicated() is None or ROW_MASK.get() is not None:
            return original()
        return global_result(metric, original)

    return result


def all_reduce_sum(tensors):
    """`tensors` summed over the replicas, differentiably (synchronized BatchNormalization's
    moments: the gradient of a sum is the sum of the gradients). In a replicated step every
    replica holds the global batch already: as they are."""
    context = _replicated()
    if context is None or REPLICATED.get():
        return tensors
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


def sum_undifferentiated(tensors):
    """`tensors` summed over the replicas, where nothing differentiates the sum (a batch's
    row count): `reduce_undifferentiated`."""
    context = _replicated()
    if context is None:
        return tensors
    return reduce_undifferentiated(context, tf.distribute.ReduceOp.SUM, tensors)


def reduce_undifferentiated(context, operation, tensors: list) -> list:
    """`context.all_reduce(operation, tensors)` for values nothing differentiates (row counts,
    metrics' states, the gradients an optimizer applies): the same collectives, without the
    gradient function.

    In a traced function `all_reduce` wraps its collectives in `tf.custom_gradient`, which
    registers a new gradient function in TensorFlow's global gradient registry at each call;
    the function holds the graph it was traced in, and with it the graphs around it (a fused
    step's loop and conditions), for the rest of the process: 96 registered over 7 fits of
    new models on 8 replicas (docs/benchmarks.md, "Memory"), and each full garbage
    collection walks what they hold. Here the
    replicas meet in `merge_call`, as `all_reduce` itself does for values it cannot
    differentiate (`IndexedSlices`): each value reduced onto its own devices. A strategy that
    reduces without `merge_call` (XLA on GPUs only) gets `all_reduce`."""
    if not library_internals.tf_replicas_merge_to_reduce():
        return context.all_reduce(operation, tensors)

    def batch_reduce(strategy, *values):
        return strategy.extended.batch_reduce_to(operation, [(v, v) for v in values])

    return list(context.merge_call(batch_reduce, args=tuple(tensors)))


def reduce_logs(values, strategy, reduction):
    """Keras's `reduce_per_replica`, except for the logs of a multi-worker step (our step
    functions reduce with this; `Runtime.make_function` gives a multi-worker step ours).

    There Keras 3 reduces every log with `strategy.reduce("MEAN", v, axis=0)`, which fails
    for the scalar logs every step returns ("Invalid reduction dimension (0 for input with 0
    dimension(s))", the second half of keras-team/keras#20585). Here they are averaged over
    every replica, as Keras means to ("mean"), in one batched all-reduce: the compiled
    metrics' results are already global in every replica (`install_global_results`), so
    their mean is that value; a custom step's own local logs get the mean over all workers,
    as MirroredStrategy gives them over its replicas.
    """
    if reduction not in ("auto", "mean") or not isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ):
        return _KERAS_REDUCE(values, strategy, reduction)
    leaves = tf.nest.flatten(values)
    picked = [
        i
        for i, v in enumerate(leaves)
        if isinstance(v, tf.distribute.DistributedValues)
        and strategy.experimental_local_results(v)[0].dtype.is_floating
    ]
    if picked:

        def mean(*local):
            context = tf.distribute.get_replica_context()
            return reduce_undifferentiated(context, tf.distribute.ReduceOp.MEAN, list(local))

        reduced = strategy.run(mean, args=tuple(leaves[i] for i in picked))
        for i, v in zip(picked, reduced):
            leaves[i] = strategy.experimental_local_results(v)[0]
    leaves = [
        strategy.experimental_local_results(v)[0]
        if isinstance(v, tf.distribute.DistributedValues)
        else v
        for v in leaves
    ]
    return tf.nest.pack_sequence_as(values, leaves)


# Keras's own, for every other reduction.
_KERAS_REDUCE = keras_internals.reduce_per_replica()
