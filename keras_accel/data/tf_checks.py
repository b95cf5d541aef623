"""What a user's tf.data pipeline is, read from its element spec and graph (imported only where
TensorFlow is in use): whether its elements are batches (`unbatched`, `maybe_unbatched`), its
batch size (`fixed_batch_size`, `graph_batch_size`), whether it reads files (`reads_files`);
and Keras's rule for the arguments passed beside it (`check_arguments`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_accel.data.inputs import standardize_element
from keras_accel.utils import library_internals


def _parts(spec) -> list[tuple[str, tf.TensorShape]]:
    """`(name, shape)` of every tensor of an element spec, named as Keras names the parts of
    a batch: x, y, sample_weight (x["key"] inside a dict, x[0] inside a tuple)."""
    named = []

    def visit(name, node):
        if isinstance(node, dict):
            for key, value in node.items():
                visit(f"{name}[{key!r}]", value)
        elif isinstance(node, (tuple, list)):
            for i, value in enumerate(node):
                visit(f"{name}[{i}]", value)
        elif hasattr(node, "shape"):
            named.append((name, node.shape))

    for name, part in zip(("x", "y", "sample_weight"), standardize_element(spec)):
        if part is not None:
            visit(name, part)
    return named


def _shapes(spec) -> str:
    return ", ".join(f"{name} {tuple(shape)}" for name, shape in _parts(spec))


def unbatched(dataset: tf.data.Dataset) -> str | None:
    """Why `dataset`'s elements cannot be batches, or None: a part without a first (rows)
    dimension, or parts whose first dimensions differ (a batch's parts share their rows).
    An unbatched data set of examples with a label or a vector of another length is told
    here; one whose examples only look like batches is `maybe_unbatched`."""
    parts = [
        (name, shape) for name, shape in _parts(dataset.element_spec) if shape.rank is not None
    ]
    scalars = [name for name, shape in parts if shape.rank == 0]
    if scalars:
        return (
            f"its elements are single examples ({_shapes(dataset.element_spec)}): "
            f"{scalars[0]} has no first dimension of rows"
        )
    firsts = {name: shape[0] for name, shape in parts if shape[0] is not None}
    if len(set(firsts.values())) > 1:
        shown = ", ".join(f"{name} {rows}" for name, rows in firsts.items())
        return (
            f"the first dimensions of its elements' parts differ ({shown}), where a batch's "
            "parts share their rows"
        )
    return None


# Ops after which a pipeline's elements are batches (batch, padded_batch, map-and-batch,
# rebatch, dense_to_sparse_batch; bucket_by_sequence_length and windows group elements),
# and sources whose elements the user makes whole (from_tensors, from_generator).
_BATCHING = ("Batch", "GroupByWindow", "Window")
_WHOLE_SOURCES = ("TensorDataset", "GeneratorDataset")


def _graph_ops(dataset: tf.data.Dataset) -> set[str] | None:
    """The op types of the pipeline's graph, its functions' included (what `map` or
    `interleave` run); None where TensorFlow cannot serialize it."""
    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=1,  # Ignore: a stateful op is no reason to warn here.
            strip_device_assignment=True,
        )
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except Exception:  # A pipeline TensorFlow cannot serialize: unknown.
        return None
    return {node.op for node in graph.node} | {
        node.op for function in graph.library.function for node in function.node_def
    }


def maybe_unbatched(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset`'s elements may be single examples: no step of its pipeline batches
    them (`_BATCHING`), its sources are not made whole by the user (`_WHOLE_SOURCES`), and
    every first dimension is fixed (a `batch` without drop_remainder leaves it unknown).
    Slices of arrays made of batches look the same, so this only informs an error that a
    `batch_size` given with the data set already causes: it serializes the pipeline's graph,
    in-memory arrays included, which is no cost to add to every call."""
    parts = _parts(dataset.element_spec)
    if not parts or any(shape.rank is None or shape[0] is None for _, shape in parts):
        return False
    ops = _graph_ops(dataset)
    if ops is None:
        return False
    return not any(any(word in op for word in _BATCHING) for op in ops) and not any(
        op.startswith(_WHOLE_SOURCES) for op in ops
    )


def check_arguments(dataset: tf.data.Dataset, y, batch_size, sample_weight) -> None:
    """Keras's rule for a tf.data.Dataset input: its batches hold the targets and weights,
    and it is batched by the user (`y`, `sample_weight` and `batch_size` are not passed).
    The error says what this data set needs: only to drop the argument, or to be batched."""
    for name, value, what in (
        ("y", y, "the targets"),
        ("sample_weight", sample_weight, "the sample weights"),
    ):
        if value is not None:
            raise ValueError(
                f"When providing `x` as a tf.data.Dataset, `{name}` should not be passed. "
                f"Instead, {what} should be included as part of the tf.data.Dataset: "
                f"(x, y{', sample_weight' if name == 'sample_weight' else ''}) batches."
            )
    if batch_size is None:
        return
    reason = unbatched(dataset)
    if reason is None and maybe_unbatched(dataset):
        reason = "no step of its pipeline batches its elements"
    if reason is not None:
        raise ValueError(
            "When providing `x` as a tf.data.Dataset, `batch_size` should not be passed: "
            f"the data set is batched by its pipeline. This one is not batched ({reason}): "
            f"pass dataset.batch({batch_size}) instead. Received: batch_size={batch_size}."
        )
    size = fixed_batch_size(dataset.element_spec) or graph_batch_size(dataset)
    batches = f"its batches, of {size} rows," if size else "its batches"
    raise ValueError(
        "When providing `x` as a tf.data.Dataset, `batch_size` should not be passed: "
        f"{batches} are the batches (dataset.rebatch(n) changes their size). Received: "
        f"batch_size={batch_size}."
    )


def fixed_batch_size(spec) -> int | None:
    """The batch dimension where the element spec fixes it (`batch(n, drop_remainder=True)`)."""
    leaves = [leaf for leaf in tf.nest.flatten(spec) if hasattr(leaf, "shape")]
    dims = {leaf.shape[0] if leaf.shape.rank else None for leaf in leaves}
    if len(dims) == 1 and None not in dims:
        return int(dims.pop())
    return None


def graph_batch_size(dataset) -> int | None:
    """The batch size of the pipeline's `batch` transformation, read from its graph without
    reading data (what Keras's multi-process `distribute_dataset` uses); None if unknown."""
    return library_internals.tf_compute_batch_size(dataset)  # None: read one batch instead.


# The ops tf.data's FILE auto-sharding shards by their file names (its `kReaderDatasetOps`,
# tensorflow/core/grappler/optimizers/data/auto_shard.cc), matched by prefix for their V2s.
_FILE_READERS = (
    "ArrayRecordDataset",
    "FixedLengthRecordDataset",
    "RecordIODataset",
    "SSTableDataset",
    "TextLineDataset",
    "TFRecordDataset",
)


def reads_files(dataset: tf.data.Dataset) -> bool:
    """Whether the pipeline's graph holds a file reader (TFRecord, text lines, ...), also
    inside a function (`list_files().interleave(tf.data.TFRecordDataset)`): what FILE
    sharding needs. True where the graph cannot be read (FILE sharding then decides)."""
    ops = _graph_ops(dataset)
    return ops is None or any(op.startswith(_FILE_READERS) for op in ops)
