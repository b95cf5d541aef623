"""A batch of a tf.data pipeline padded to its static size, in the graph (imported only where
TensorFlow is in use).

Every tf.data path (`keras_accel.data.tfdata`'s arrays, `keras_accel.data.tf_datasets`'
streams, `keras_accel.data.tf_process_files`' shares) hands each batch's real rows to the
function `batch_padder` makes, which optionally runs a model's own preprocessing first (a
keras-hub task's `preprocess_samples`: raw strings in, token ids out), then pads to the
static size and adds the row mask (see `keras_accel.data.batching`).
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from keras_accel.data.batching import pack
from keras_accel.data.inputs import standardize_element

Preprocess = Callable | None


def rows_of(x):
    """The rows of a batch (of its first tensor), in the graph."""
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _bucket(rows, static: int):
    """`keras_accel.data.batching.bucket_rows` in the graph: `static`, doubled until it
    holds `rows` (integers only: a float log2 of an exact power may round up)."""
    static = tf.constant(static, tf.int32)
    rows = tf.cast(rows, tf.int32)
    return tf.while_loop(lambda size: size < rows, lambda size: size * 2, [static])[0]


def _pad_leaf(t, static: int, target=None, repeat: bool = True):
    """`t` padded to `static` rows; to `target` (a bucket, a tensor) where the stream's
    batches may outgrow the first, its batch dimension then unknown to tf.data. With copies
    of its last row (`repeat`: inputs, targets), else zeros (weights, the row mask)."""
    t = tf.convert_to_tensor(t)
    rows = tf.shape(t)[0]
    fill = "" if t.dtype == tf.string else tf.zeros([], t.dtype)
    if target is None:
        # The pad must wait for the check, else its negative padding may fail first, with
        # TensorFlow's "Paddings must be non-negative" (automatic control dependencies order
        # the stateful ops among themselves, not the pure ops after them).
        check = tf.debugging.assert_less_equal(
            rows,
            static,
            message=(
                f"keras_accel: a batch has more rows than the pipeline's batch size ({static} "
                "rows, rounded up to a replica multiple), which its `batch` step fixes: the "
                "step is compiled for that size. Batch the data set with one batch size "
                "(`dataset.batch(n)`) as its last step"
            ),
        )
        with tf.control_dependencies([check]):
            rows = tf.identity(rows)
        target, first = static, static
    else:
        first = None  # Any bucket: tf.data's element spec leaves the rows unknown.
    if repeat:
        # Copies of the last real row (`keras_accel.data.batching.pad_rows` says why); a
        # tf.data batch has at least one row.
        rows = tf.cast(rows, tf.int32)
        padded = tf.gather(t, tf.minimum(tf.range(target), tf.maximum(rows - 1, 0)))
        if t.shape.rank is None:
            return padded
    elif t.shape.rank is None:  # E.g. `tf.io.parse_tensor`'s output: the rank is known later.
        zeros = tf.zeros([tf.rank(t) - 1, 2], tf.int32)
        paddings = tf.concat([[[0, target - tf.cast(rows, tf.int32)]], zeros], axis=0)
        return tf.pad(t, paddings, constant_values=fill)
    else:
        widths = [[0, target - rows]] + [[0, 0]] * (t.shape.rank - 1)
        padded = tf.pad(t, widths, constant_values=fill)
    return tf.ensure_shape(padded, [first] + t.shape[1:].as_list())


def batch_padder(
    static: int,
    carry_mask: bool,
    preprocess: Preprocess,
    scales=None,
    grows: bool = False,
    remainder: str = "pad",
):
    """`fn(index, x, y, sample_weight)` -> the padded batch, as the Accelerator feeds it.

    With `carry_mask` (the Accelerator's own steps, `keras_accel.loop`) a batch carries the
    user's weights as they are (1 where none were given; 0 on padding) and the row mask: the
    step weights it. Without (`Accelerator.dataset`, for a plain `model.fit`) the weights are
    scaled here: by the batch plan's table `scales` where the data set's rows are known,
    else by the batch's own `static / real rows`. `grows`: a batch larger than `static`
    is padded to its bucket (`_bucket`) instead of refused. `remainder` (a stream's plan's,
    `keras_accel.data.batching.UNPADDED`): "whole", every batch as it came, unpadded;
    "cut" (and "replicate", whose marked batch every replica reads whole), a batch with
    padding marked with its real rows (`_marker`), which the step cuts it to."""
    table = None if scales is None else tf.constant(scales, tf.float32)

    def fn(index, x, y, sample_weight):
        if preprocess is not None:
            x, y, sample_weight = standardize_element(preprocess(x, y, sample_weight))
        rows = rows_of(x)
        target = _bucket(rows, static) if grows else None
        if remainder == "whole":
            target = rows  # Nothing padded: the batch as it came.
        pad = lambda t: _pad_leaf(t, static, target)  # noqa: E731
        zeros = lambda t: _pad_leaf(t, static, target, repeat=False)  # noqa: E731
        marked = remainder in ("cut", "replicate")
        cut = _marker(rows, static if target is None else target) if marked else None
        if y is None:
            if not carry_mask:
                return (tf.nest.map_structure(pad, x),)
            return pack(tf.nest.map_structure(pad, x), None, None, zeros(tf.ones([rows])), cut)
        if sample_weight is None:
            weights = tf.ones([rows], tf.float32)
        else:
            weights = tf.cast(sample_weight, tf.float32)
        if not carry_mask:
            if table is not None:
                scale = tf.gather(table, index)
            else:
                size = static if target is None else target
                scale = tf.cast(size, tf.float32) / tf.cast(rows, tf.float32)
            weights = weights * scale
        x, y = (tf.nest.map_structure(pad, t) for t in (x, y))
        weights = tf.nest.map_structure(zeros, weights)
        if not carry_mask:
            return x, y, weights
        return pack(x, y, weights, zeros(tf.ones([rows], tf.float32)), cut)

    return fn


def _marker(rows, padded):
    """`keras_accel.data.batching.pack`'s marker in the graph: an empty `(0, rows)` array
    for a batch of `rows` real rows padded to `padded`, `(0, 0)` for a full one."""
    rows, padded = tf.cast(rows, tf.int32), tf.cast(padded, tf.int32)
    return tf.zeros(tf.stack([0, tf.where(rows < padded, rows, 0)]), tf.float32)


def mapped_element(element: tuple):
    # tf.data passes a tuple element's parts as separate arguments, anything else as one.
    return standardize_element(element[0] if len(element) == 1 else element)
