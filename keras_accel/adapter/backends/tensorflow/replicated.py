"""TensorFlow, several replicas: the short last batch that every replica runs whole
(`remainder="replicate"`, docs/accelerator.md "Padded, unpadded or dropped").

Where the model's code cannot weight padding rows out, the last partial batch runs on its
real rows alone. Each replica of a `MirroredStrategy` runs its own program on its share of
every batch, and those rows need not split evenly; so every replica runs the step on all
of them, as one device does, and nothing in that step crosses the replicas but what sums
back to one device's numbers (`steps.REPLICATED`): each replica's gradient is of its loss
over the whole batch divided by the replica count, as Keras divides every replica's loss,
so their sum is one device's (a custom `train_step`'s loss is whole, and the replicas'
gradients are averaged, `losses.runs_as_one_device`); BatchNormalization's moments and
users' metrics' rows are not gathered; per-row random layers draw for the batch as one
device; Keras's metrics count the first replica's rows (`global_rows.FirstReplicaCounts`).

The other batches come from the call's `tf.data` pipeline, whose elements share one static
shape, as ever; the short batch, of its own shape, comes from the host, whole in every
replica (`experimental_distribute_values_from_function`), through a step function traced
for it alone (`replicated_function`), so that neither the pipeline's shapes nor the other
steps' program change. `TailIterator` is the epoch's iterator that Keras's trainer hands
the step function: the pipeline's, then that batch.
"""

from __future__ import annotations

import copy
import dataclasses

import tensorflow as tf

from keras_accel.adapter.backends.tensorflow.reduction import reduce_logs
from keras_accel.data.batching import element


def padded_batches(batches):
    """`batches` (arrays under `remainder="replicate"`) as the call's pipeline reads them:
    padded (`remainder="pad"`), of which it takes all but the last, so every batch it gives
    is full. The same arrays, order and epochs (the epoch listeners are shared)."""
    padded = copy.copy(batches)
    padded.plan = dataclasses.replace(batches.plan, remainder="pad")
    return padded


def tail_of(batches):
    """The short last batch of `batches` as its step takes it: its real rows, marked
    (`batching.pack`), as numpy arrays, read when it comes (its epoch's order)."""
    index = batches.plan.num_batches - 1
    cut = batches.plan.cut_rows(index)

    def read():
        return element(batches.batch(index), True, None, cut=cut)

    return read


class TailIterator:
    """An epoch's batches for a `replicated_function`: `full` batches from `inner` (the
    pipeline's distributed iterator, read by the regular step function), then `tail()`
    whole in every replica."""

    def __init__(self, inner, full: int, tail, strategy):
        self.inner = inner
        self.full = full
        self.tail = tail
        self.strategy = strategy
        self.read = 0

    def __iter__(self):
        return self

    def __next__(self):
        """The next batch as distributed values (a read outside the step functions)."""
        self.read += 1
        if self.read <= self.full:
            return next(self.inner)
        if self.read == self.full + 1:
            return self.distributed_tail()
        raise StopIteration

    def distributed_tail(self):
        data = self.tail()
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: tf.nest.map_structure(
                lambda a: None if a is None else tf.convert_to_tensor(a), data
            )
        )


def first_replica() -> bool:
    """Whether this is the first replica's program (outside a replica: the only one). A
    `MirroredStrategy` replica's index is a constant of its program."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return True
    index = tf.get_static_value(context.replica_id_in_sync_group)
    return index is None or int(index) == 0


def replicated_function(model, kind: str, regular):
    """`kind`'s step function for a call whose last batch every replica runs whole: the
    regular step function (`regular`) for the pipeline's batches, and a step traced for the
    short batch's shape for it, its data the same in every replica."""
    step = getattr(model, f"{kind}_step")
    strategy = model.distribute_strategy

    @tf.function
    def whole(data):
        outputs = strategy.run(step, args=(data,))
        return reduce_logs(outputs, strategy, reduction="auto")

    def function(iterator):
        if not isinstance(iterator, TailIterator):
            return regular(iterator)
        if iterator.read < iterator.full:
            iterator.read += 1
            return regular(iterator.inner)
        if iterator.read > iterator.full:
            raise StopIteration
        iterator.read += 1
        return whole(iterator.distributed_tail())

    return function
