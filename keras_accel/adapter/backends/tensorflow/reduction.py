"""Reductions across replicas inside a step: sums, metrics' global results, and the logs
of a multi-worker step."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_accel.utils import keras_internals


def global_result(metric, result):
    """`metric`'s result over every replica's rows, from inside a replica: its variables
    reduced as a cross-replica read would reduce them (Keras's are SUM, on read)."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return result()
    operations = {
        tf.VariableAggregation.SUM: tf.distribute.ReduceOp.SUM,
        tf.VariableAggregation.MEAN: tf.distribute.ReduceOp.MEAN,
    }
    values = []
    grouped: dict = {}  # (operation, dtype) -> indices of the variables it reduces
    for i, variable in enumerate(metric.variables):
        operation = operations.get(getattr(variable.value, "aggregation", None))
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
        reduced = context.all_reduce(operation, [values[i] for i in indices])
        for i, value in zip(indices, reduced):
            values[i] = value
    with keras.StatelessScope(state_mapping=list(zip(metric.variables, values))):
        return result()


def all_reduce_sum(tensors):
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensors
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)


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
            return context.all_reduce(tf.distribute.ReduceOp.MEAN, list(local))

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
