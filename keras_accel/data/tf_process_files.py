"""One process's own files of a file-backed tf.data pipeline, read in its share of each
global batch (imported only where TensorFlow is in use): whether it can be (`process_files`),
and its batches (`ProcessFiles`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_accel.data.batching import StreamPlan, padding_like
from keras_accel.data.tf_checks import graph_batch_size, reads_files
from keras_accel.data.tf_datasets import TFDatasetBatches
from keras_accel.data.tf_padding import Preprocess, batch_padder, mapped_element, rows_of
from keras_accel.utils import library_internals
from keras_accel.utils.printing import print_msg


class ProcessFiles:
    """One process's own files of a file-backed tf.data pipeline, in its own batches.

    Where several processes train together and the pipeline reads at least as many files
    as there are processes, each process reads only its files (tf.data's FILE auto-sharding
    of the pipeline's graph, as `tf.distribute` and Keras's own multi-process
    `distribute_dataset` apply it) and batches them `batch_size / processes` rows at a time:
    its share of each global batch. Nothing is counted first. The processes' files hold
    different numbers of rows, so their data ends after different numbers of batches; where
    one process's data has ended and another's has not, the one feeds padding (row mask 0)
    until all have ended. On TensorFlow `tf.distribute`'s partial-batch handling does that
    (an empty batch for a worker that ran out, agreed per step by an all-reduce); on JAX
    `keras_accel.utils.process.EndAgreement` (`batches()`).

    A global batch is then process 0's next rows beside process 1's (and so on), not the
    pipeline's next `batch_size` rows: training sees other batches than in one process,
    while evaluation, a mean over every row, is the same.
    """

    reiterable = True

    def __init__(self, shard: tf.data.Dataset, plan: StreamPlan):
        self.shard = shard
        self.plan = plan
        self._preprocess = None
        self._firsts = {}  # By preprocessing: the raw batch (checks) or the model's (build).

    def pipeline(self, carry_mask: bool = True, preprocess: Preprocess = None):
        """This process's batches, padded to its share of the global batch (`plan`)."""
        pad = batch_padder(self.plan.static_rows, carry_mask, preprocess)
        dataset = self.shard
        if self.plan.remainder == "drop":
            full = self.plan.batch_size
            dataset = dataset.filter(lambda *e: rows_of(mapped_element(e)[0]) >= full)
        return dataset.map(
            lambda *e: pad(None, *mapped_element(e)), num_parallel_calls=tf.data.AUTOTUNE
        ).prefetch(tf.data.AUTOTUNE)

    def with_preprocess(self, preprocess: Preprocess) -> ProcessFiles:
        """The same files, fed through a keras-hub task's preprocessing (`batches()`)."""
        self._preprocess = preprocess
        return self

    def first_batch(self):
        """This process's first padded batch, `(x, y, sample_weight, row_mask)` as numpy."""
        self._read_first()
        return self._firsts[id(self._preprocess)]

    def is_empty(self) -> bool:
        """Whether this process's share holds no batch, padded and filtered as it will be
        fed (under "drop" a small share may be empty). Reads the first batch, once: then
        `first_batch` serves it."""
        return self._read_first() is None

    def _read_first(self):
        key = id(self._preprocess)
        if key not in self._firsts:
            for element in self.pipeline(True, self._preprocess).take(1):
                self._firsts[key] = _numpy_batch(element)
        return self._firsts.get(key)

    def batches(self, scale: bool = False):
        """One pass of this process's padded batches, then padding batches until every
        process's data has ended (JAX: `EndAgreement`)."""
        from keras_accel.utils.process import EndAgreement

        if scale:
            raise ValueError("Per-process files feed the Accelerator's own steps only.")
        ends = EndAgreement()
        step = 0
        for element in self.pipeline(True, self._preprocess).as_numpy_iterator():
            ends.have(step + 1)
            yield _numpy_batch(element)
            step += 1
        if not ends.more(step):
            return
        padding = padding_like(self.first_batch())
        while True:
            yield padding
            step += 1
            if not ends.more(step):
                return


def _numpy_batch(element):
    from keras_accel.data.batching import unpack

    x, y, sample_weight, row_mask = unpack(element)
    as_numpy = lambda t: None if t is None else np.asarray(t)  # noqa: E731
    return tuple(tf.nest.map_structure(as_numpy, t) for t in (x, y, sample_weight, row_mask))


def process_files(batches: TFDatasetBatches, num_processes: int, index: int) -> ProcessFiles | None:
    """`batches`' pipeline as this process's own files (`ProcessFiles`), or None where it
    cannot be: its batch size is not known from its graph or not a multiple of the process
    count, it reads no files, it has fewer files than processes, or this process's share
    is empty. Reads at most one of this process's batches (the FILE-sharding check, which
    tf.data makes when a pipeline is first read). Every process must agree on the answer
    before using it (the Runtimes' `agree_all`)."""
    plan = batches.plan
    policy = batches.source.options().experimental_distribute.auto_shard_policy
    if policy == tf.data.experimental.AutoShardPolicy.OFF:
        return None  # The user shards it, or wants it read whole: as it says.
    size = graph_batch_size(batches.source)
    if size is None or size % num_processes or plan.static_rows % num_processes:
        return None
    if not reads_files(batches.source):
        # Asking tf.data's FILE sharding would answer the same, after logging an error
        # with the pipeline's graph in every process ("tf_auto_shard failed").
        return None
    try:
        auto_shard_dataset = library_internals.tf_auto_shard_dataset()
    except library_internals.LibraryInternalsError as error:
        # Reading one's own files only saves reading; every process reading the whole
        # pipeline (and keeping its rows) gives the same batches.
        _note_once(f"keras_accel: each process reads the whole pipeline ({error})")
        return None
    try:
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.FILE
        )
        local = batches.source.rebatch(size // num_processes).with_options(options)
        shard = auto_shard_dataset(
            local, num_workers=num_processes, index=index, num_replicas=num_processes
        )
    except (ValueError, tf.errors.OpError):
        return None  # Not FILE-shardable here: no reader op found in the graph.
    local_plan = StreamPlan(
        batch_size=size // num_processes,
        static_rows=plan.static_rows // num_processes,
        num_batches=None,  # Each process's own count, never known in advance.
        pads=True,  # A process whose data ended feeds padding until all have ended.
        remainder=plan.remainder,
        training=plan.training,
        kind="tf.data.Dataset (this process's files)",
    )
    own = ProcessFiles(shard, local_plan)
    try:
        empty = own.is_empty()  # The raw first batch, read once (`first_batch`).
    except tf.errors.OpError:
        return None  # Not FILE-shardable here: no reader op, or fewer files than processes.
    if empty:
        return None  # An empty share.
    return own


_NOTED: set = set()


def _note_once(message: str) -> None:
    if message not in _NOTED:
        _NOTED.add(message)
        print_msg(message)
