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

A stream's (a generator's, a `PyDataset`'s) short batch is known only when it arrives, and a
`tf.distribute` pipeline splits every batch it holds. So such a stream is read on the host,
a batch at a time, as Keras's own adapter reads it for its numpy iterator (`HostStream`),
and each batch reaches the replicas as it comes: a full one split into their slices, as
`tf.distribute` splits it, through a step traced for those; one with padding (marked,
`batching.cut_rows`) whole in every replica, through the step traced for its shape
(`StreamIterator`). Keras's TF trainer takes a Python iterator so too (its
`one_step_on_data` per element). A user's `tf.data.Dataset` goes the same way: its
pipeline, padded and marked in its graph (`tf_padding.batch_padder`), is read eagerly on
the host, a batch per step, instead of through `tf.distribute`.
"""

from __future__ import annotations

import copy
import dataclasses

import tensorflow as tf

from keras_accel.adapter.backends.tensorflow.reduction import reduce_logs
from keras_accel.data.batching import cut_rows, element, num_rows


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
            lambda context: _tensors(data)
        )


class HostStream(tf.distribute.DistributedDataset):
    """A stream's batches as Keras's TF epoch iterator takes them (it takes a
    `DistributedDataset` as it is, and makes an iterator of it each epoch): each epoch's
    from `epoch()`, an iterator over its batches read on the host when the step comes: a
    generator's or a PyDataset's from Keras's data adapter of it (`get_numpy_iterator`: its
    epochs, a PyDataset's `on_epoch_end`), a tf.data pipeline's from a pass over it (eager
    tensors on the host)."""

    def __init__(self, epoch, strategy):
        self.epoch = epoch
        self.strategy = strategy

    def __iter__(self):
        return StreamIterator(self.epoch, self.strategy)


class StreamIterator:
    """An epoch of a stream's batches (`HostStream`), each as `(distributed, whole)`: its
    values over the replicas, and whether every replica holds it whole (a batch with
    padding, marked with its real rows, which the step cuts it to: `batching.cut_rows`)
    rather than its slice of it."""

    def __init__(self, epoch, strategy):
        self.epoch = epoch
        self.batches = None
        self.strategy = strategy

    def __iter__(self):
        return self

    def __next__(self):
        if self.batches is None:
            # Made at the first read: Keras asks for the next epoch's iterator at an
            # epoch's end and may drop it unread (a tf.data iterator costs its making).
            self.batches = self.epoch()
        data = next(self.batches)  # StopIteration ends the epoch, as Keras reads a stream.
        if cut_rows(data):
            return self.strategy.experimental_distribute_values_from_function(
                lambda context: _tensors(data)
            ), True
        count = self.strategy.num_replicas_in_sync
        rows = num_rows(data[0]) // count  # Its inputs' rows.

        def share(context):
            # Replica i's slice, as `tf.distribute` splits a batch: rows [i*n, (i+1)*n). (The
            # marker has no rows: each replica's is the batch's.)
            begin = context.replica_id_in_sync_group * rows
            return _tensors(
                tf.nest.map_structure(
                    lambda a: None if a is None else a[begin : begin + rows], data
                )
            )

        return self.strategy.experimental_distribute_values_from_function(share), False


def _tensors(data):
    return tf.nest.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a), data)


def first_replica() -> bool:
    """Whether this is the first replica's program (outside a replica: the only one). A
    `MirroredStrategy` replica's index is a constant of its program."""
    context = tf.distribute.get_replica_context()
    if context is None:
        return True
    index = tf.get_static_value(context.replica_id_in_sync_group)
    return index is None or int(index) == 0


def replicated_function(model, kind: str, regular):
    """`kind`'s step function for a call whose short batches every replica runs whole: the
    regular step function (`regular`) for the pipeline's batches, and a step traced for the
    short batch's shape for it, its data the same in every replica. A stream's batches
    (`StreamIterator`) come one per call, distributed already: a full one runs through a
    step traced for its slices (compiled as Keras compiles its own), one with padding
    through the short batch's."""
    step = getattr(model, f"{kind}_step")
    strategy = model.distribute_strategy

    @tf.function
    def whole(data):
        outputs = strategy.run(step, args=(data,))
        return reduce_logs(outputs, strategy, reduction="auto")

    # Full batches of any shape a stream gives (sequences of varying length) take one
    # trace, as Keras's own steps do (`reduce_retracing`); `whole` keeps the short batch's
    # marker shape concrete (`cut_rows` reads it).
    @tf.function(jit_compile=bool(model.jit_compile), reduce_retracing=True)
    def split(data):
        # (A function of its own, not `whole` compiled twice: TensorFlow counts a Python
        # function's traces together, and warns of retracing past a few.)
        outputs = strategy.run(step, args=(data,))
        return reduce_logs(outputs, strategy, reduction="auto")

    def function(iterator):
        if isinstance(iterator, StreamIterator):
            data, replicated = next(iterator)
            return (whole if replicated else split)(data)
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
