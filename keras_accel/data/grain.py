"""Grain inputs (`grain.MapDataset`, `grain.IterDataset`, `grain.DataLoader`), as Keras reads
them: one full pass of the data set per epoch, on JAX and on TensorFlow; and, where several
JAX processes train together, each process's own rows of a batched `MapDataset`
(`process_share`).

A Python generator cannot tell Keras where an epoch ends, and Keras reads one on from where
the last epoch stopped; a Grain data set is re-iterable, and Keras's own Grain adapter starts
a fresh pass every epoch (ended by the pass's end; `steps_per_epoch` only where given). So
a Grain data set reaches Keras as `GrainPasses`, a Keras `DataAdapter` (Keras's
`get_data_adapter` takes any `DataAdapter` as it is), each of whose iterators is a new pass
of `keras_accel.data.sources.IterableBatches.batches()`: padded batches with their row mask.

The batches are numpy already (`IterableBatches` converts what the data set yields). This
module is imported only when a Grain data set (or another re-iterable stream) is given, and
imports Grain only to build one process's share of a data set the user made with it.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.data.batching import StreamPlan, element, padding_like, static_batch_size
from keras_accel.utils import library_internals


def import_grain():
    """The `grain` module, or an error that says how to install it: Grain is the optional
    `grain` extra of keras-accel (in `all`, not in `jax` or `tensorflow`)."""
    import importlib.util

    if importlib.util.find_spec("grain") is None:
        raise ModuleNotFoundError(
            "Grain data sets need the `grain` package, the optional `grain` extra of "
            'keras-accel: pip install "keras-accel[grain]" (from a checkout: pip install '
            '-c constraints.txt -e ".[grain]"; the "all" extra has it too).',
            name="grain",
        )
    import grain  # Installed but broken (e.g. too old for this Python): its own error.

    return grain


class GrainPasses(PaddedBatchesAdapter):
    """A Keras data adapter over a re-iterable `IterableBatches`: each `get_*_iterator()` is
    one new pass of the data set, its batches as `keras_accel.data.pydataset.stream` serves
    them (`carry_mask`, `rows`: this process's rows of each global batch). On JAX a
    process's own files of a tf.data pipeline
    (`keras_accel.data.tf_process_files.ProcessFiles`) are served the same way: one pass per
    epoch, its padded batches as numpy.

    `num_batches` is the data set's length where it knows one (a `MapDataset`; not under
    remainder="drop", which may skip a partial batch): Keras then ends an epoch after that
    many steps and starts the next pass. Without one (an `IterDataset`, a `DataLoader`) the
    pass's end ends the epoch, as under Keras's own Grain adapter (which says so each epoch:
    "Your input ran out of data").
    """

    def __init__(self, batches, carry_mask: bool = True, rows=None):
        self.batches = batches
        self.carry_mask = carry_mask
        self.rows = rows
        self._tf_signature = None

    def _pass(self):
        for batch in self.batches.batches(scale=not self.carry_mask):
            yield element(batch, self.carry_mask, self.rows, self.batches.plan.static_rows)

    def keras_accel_first_batch(self):
        # What `Accelerator` builds the model from (`_first_batch`): the stream's first
        # batch, kept aside (only its structure and shapes beyond the batch axis count).
        return self.batches.first_batch()

    def get_numpy_iterator(self):
        return self._pass()

    def get_jax_iterator(self, super_batch=None):
        return self.jax_batches(self._pass(), super_batch)

    def get_torch_dataloader(self):
        # Keras's torch trainer iterates what this returns; numbers become torch tensors on
        # this process's device, as Keras's own adapters convert them.
        def one_pass():
            for item in self._pass():
                yield keras.tree.map_structure(_torch_leaf, item)

        return one_pass()

    def get_tf_dataset(self):
        import tensorflow as tf

        if self._tf_signature is None:
            first = element(self.batches.first_batch(), self.carry_mask, self.rows)
            self._tf_signature = tf.nest.map_structure(
                _tensor_spec, keras.tree.lists_to_tuples(first)
            )

        def one_pass():
            for item in self._pass():
                yield keras.tree.lists_to_tuples(item)

        dataset = tf.data.Dataset.from_generator(one_pass, output_signature=self._tf_signature)
        return dataset.prefetch(tf.data.AUTOTUNE)

    @property
    def num_batches(self):
        return self.batches.plan.num_batches


def _torch_leaf(leaf):
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
        return keras.ops.convert_to_tensor(leaf)
    return leaf


def _tensor_spec(leaf):
    import tensorflow as tf

    leaf = np.asarray(leaf)
    dtype = tf.string if leaf.dtype.kind in "OUS" else tf.as_dtype(leaf.dtype)
    return tf.TensorSpec(leaf.shape, dtype)


class ProcessShare:
    """One process's own rows of a batched Grain `MapDataset`, in its own batches.

    Where several processes train together, process `p` of `n` (its place along the batch
    axis) reads rows `p * b ... (p + 1) * b - 1` of every batch of `B` rows, `b = B / n`:
    the block of each global batch that its devices hold, read by index from the batch's
    parent (`parent[row]`; Grain's `MapDataset` is random access). Nothing else is read,
    nothing is counted first. The global batch that the processes' blocks make side by side
    is the one process's batch, row for row and in order: training, evaluation and
    `predict` equal one process's.

    The last batch of `B` rows may leave a process's block short or empty: its rows are
    padded (row mask 0), and a process whose data ended one batch early feeds one batch of
    padding, so that every process runs `total` steps (the data set's length in batches,
    which a `MapDataset` knows).
    """

    reiterable = True

    def __init__(self, local, total: int, plan: StreamPlan):
        self.local = local  # `IterableBatches` of this process's rows.
        self.total = total
        self.plan = plan

    def with_preprocess(self, preprocess) -> ProcessShare:
        if preprocess is not None:
            from keras_accel.data.sources import refuse_preprocessing

            refuse_preprocessing(self.local, preprocess)
        return self

    def first_batch(self):
        """This process's first padded batch, `(x, y, sample_weight, row_mask)`."""
        return self.local.first_batch()

    def batches(self, scale: bool = False):
        """One pass of this process's padded batches, then padding up to `total` steps."""
        if scale:
            raise ValueError("A process's own rows feed the Accelerator's own steps only.")
        step = 0
        for batch in self.local.batches():
            yield batch
            step += 1
        if step < self.total:
            padding = padding_like(self.first_batch())
            for _ in range(self.total - step):
                yield padding


def _shareable(source, num_processes: int, num_replicas: int, remainder: str):
    """(batching, rows per pass) where processes can share `source` by rows, else None."""
    batching = library_internals.grain_batching(source)
    if batching is None:
        return None
    size = batching.batch_size
    if size % num_processes or num_replicas % num_processes:
        return None
    try:
        length = len(batching.parent)
    except TypeError:
        return None
    if batching.drop_remainder or remainder == "drop":
        length -= length % size  # Only whole batches: a partial one is skipped.
    if length < size:
        return None  # Less than one batch: a process's first batch would be short.
    return batching, length


def shared_static_rows(source, num_processes: int, num_replicas: int, remainder: str):
    """The static rows of each global batch where `num_processes` processes can each read
    their own rows of the Grain data set `source` (`process_share`), else None: it is not
    `parent.batch(B)` (or that `.to_iter_dataset()`), `B` or the replica count is not a
    multiple of the process count, or it holds less than one batch. Reads no data; every
    process decides alike, and all must agree before sharing (the Runtimes' `agree_all`)."""
    found = _shareable(source, num_processes, num_replicas, remainder)
    if found is None:
        return None
    return static_batch_size(found[0].batch_size, num_replicas)


def process_share(
    source, num_processes: int, position: int, num_replicas: int, remainder: str, training: bool
) -> SharedBatches:
    """The Grain data set `source` as this process's own rows of every batch (a
    `SharedBatches`, whose `own_files` is the `ProcessShare`), where `shared_static_rows`
    said it can be. `position`: this process's place along the batch axis (rows
    `position * B / n ...` of each batch of `B` are its devices'). Reads this process's
    first batch only."""
    batching, length = _shareable(source, num_processes, num_replicas, remainder)
    size = batching.batch_size
    drop = batching.drop_remainder or remainder == "drop"
    block = size // num_processes
    whole, last = divmod(length, size)
    rows = whole * block + min(max(last - position * block, 0), block)
    parent, start = batching.parent, position * block

    def row(k):
        return parent[(k // block) * size + start + k % block]

    grain = import_grain()
    local = grain.MapDataset.range(rows).map(row)
    local = local.batch(block, drop_remainder=drop, batch_fn=batching.batch_fn)
    if batching.read_options is not None:
        local = local.to_iter_dataset(batching.read_options)
    from keras_accel.data.sources import IterableBatches

    own = IterableBatches(
        local, num_replicas=num_replicas // num_processes, remainder=remainder, training=training
    )
    total = whole + (1 if last else 0)
    # The length one process's `IterableBatches` gives the same data set: a MapDataset's
    # (a repeated one's is huge, ~sys.maxsize / B, and ended by `steps_per_epoch`).
    known = batching.read_options is None and remainder == "pad"
    kind = f"{type(source).__name__} (this process's rows)"
    plan = dataclasses.replace(own.plan, num_batches=total if known else None, pads=True, kind=kind)
    share = ProcessShare(own, total, plan)
    return SharedBatches(source, share, num_processes, size)


class SharedBatches:
    """The feeder's batches of a Grain data set that the processes share by rows: the
    global view (`plan`: global batches of `batch_size` rows) of this process's
    `ProcessShare` (`own_files`, what the runtime feeds, as a tf.data pipeline's own files
    are fed)."""

    reiterable = True

    def __init__(self, source, share: ProcessShare, num_processes: int, batch_size: int):
        self.source = source
        self.kind = type(source).__name__
        self.own_files = share
        self.has_targets = share.local.has_targets
        self.weighted = share.local.weighted
        self.plan = dataclasses.replace(
            share.plan,
            batch_size=batch_size,
            static_rows=share.plan.static_rows * num_processes,
            kind=self.kind,
        )

    def first_batch(self):
        return self.own_files.first_batch()
