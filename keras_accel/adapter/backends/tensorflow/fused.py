"""N train or test steps in one `tf.function` under a tf.distribute strategy."""

from __future__ import annotations

import tensorflow as tf

from keras_accel.adapter import guard
from keras_accel.adapter.backends.tensorflow.reduction import reduce_logs
from keras_accel.data import tfdata


def fused_function(model, kind: str):
    """One train (or test) step, or up to N of them in one `tf.function`, as Keras's TF function for
    `steps_per_execution` = N, in a form that also runs under a tf.distribute strategy.
    N is the model's `steps_per_execution` at each call, a tensor of the program: one
    compiled program runs every N > 1 (as Keras's JAX function does), so that a call
    fusing another N than the last (an `evaluate` after `fit`'s validation) does not
    compile its step again.

    Keras's own puts each step in a `tf.cond` (inside its while-loop) around a nested
    `tf.function`; under MirroredStrategy the replicas' merge_call then fails ("You must feed
    a value for placeholder tensor 'while/cond/Placeholder'", keras-team/keras#19246, also
    with plain Keras). Here the steps are the body of a `tf.while_loop` and only fetching
    the next batch is conditional, as tf.keras did. The loop stops after n steps or when the
    data ends (a last group of fewer steps, same program): the logs are the last step's.
    """
    step = getattr(model, f"{kind}_step")
    strategy = model.distribute_strategy
    reduce = reduce_logs
    # The per-replica shapes of the first call site's batch. The loop body's batch comes
    # out of `get_next_as_optional` with its batch dimension unknown; a step that reads a
    # static size there (Keras's per-output loss trackers weight each batch's loss by
    # `y_pred.shape[0]`, and count it once when that is None) would then see another batch
    # than the first call site, so it is given the same static shapes.
    shapes: list = []

    def replica_step(data):
        leaves = tf.nest.flatten(data)
        if not shapes:
            shapes.extend(getattr(leaf, "shape", None) for leaf in leaves)
        else:
            leaves = [_with_shape(leaf, shape) for leaf, shape in zip(leaves, shapes)]
            data = tf.nest.pack_sequence_as(data, leaves)
        return step(data)

    def one(data):
        outputs = strategy.run(replica_step, args=(data,))
        return reduce(outputs, strategy, reduction="auto")

    jit = bool(model.jit_compile)
    if jit:  # As Keras compiles one step: with XLA where the model asks.
        one = tf.function(one, jit_compile=True, reduce_retracing=True)
    # One replica with XLA: the whole group is one XLA program (`_XlaGroup`), not one
    # launch per step.
    grouped = _XlaGroup(model, step, strategy, reduce) if jit else None

    @tf.function
    def steps(iterator, n):
        shapes.clear()  # Each trace records its own first batch.
        outputs = one(next(iterator))

        def more(i, optional, outputs):
            return tf.logical_and(i < n, optional.has_value())

        def body(i, optional, outputs):
            # The same step again, in the same program (inlined: a nested function here
            # makes TensorFlow's compilation several times slower under a strategy).
            with guard.same_program(model):
                outputs = one(optional.get_value())
            optional = tf.cond(i + 1 < n, iterator.get_next_as_optional, lambda: optional)
            return i + 1, optional, outputs

        first = (tf.constant(1), iterator.get_next_as_optional(), outputs)
        return tf.while_loop(more, body, first)[2]

    @tf.function
    def single(iterator):
        shapes.clear()
        return one(next(iterator))

    def function(iterator):
        n = int(model.steps_per_execution)
        if is_group(iterator.element_spec):  # Read as groups (`Runtime.grouped`).
            if grouped is None:
                raise RuntimeError(
                    "keras_accel: groups of batches reached a step function without XLA "
                    f"(the model's jit_compile is {model.jit_compile!r}); please report this."
                )
            return grouped.run_group(iterator)
        if n == 1:  # A multi-worker step (`Runtime.make_function`): no loop, no look-ahead.
            return single(iterator)
        if grouped is not None and grouped.takes(iterator.element_spec, n):
            return grouped(iterator, tf.constant(n, tf.int32))
        return steps(iterator, tf.constant(n, tf.int32))

    return function


def _with_shape(leaf, shape):
    if not isinstance(leaf, tf.Tensor) or shape is None or not leaf.shape.is_compatible_with(shape):
        return leaf
    leaf = tf.identity(leaf)
    leaf.set_shape(shape)
    return leaf


# Bytes of the batches a group holds at once on the device (`_XlaGroup`): past this, a
# step's own work dwarfs what a launch costs, and N whole batches would take memory.
_GROUP_BYTES = 64 * 2**20


def fits_one_program(spec, copies: int = 1) -> bool:
    """Whether `copies` batches of `spec` can be one input of the XLA group program: every
    leaf a tensor of known shape, no strings, at most `_GROUP_BYTES` in all."""
    leaves = tf.nest.flatten(spec)
    if not all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        return False
    if any(leaf.dtype == tf.string or not leaf.shape.is_fully_defined() for leaf in leaves):
        return False
    size = sum(leaf.shape.num_elements() * leaf.dtype.size for leaf in leaves)
    return fits_group_bytes(size * copies)


def fits_group_bytes(size: int) -> bool:
    """Whether a group of `size` bytes is within the XLA group program's limit."""
    return size <= _GROUP_BYTES


def is_group(spec) -> bool:
    """Whether an iterator's elements are groups of batches (`tfdata.ArrayGroups`)."""
    return isinstance(spec, dict) and tfdata.GROUP_STEPS in spec


class _XlaGroup:
    """Up to N steps as one XLA program, for a model compiled with `jit_compile=True` on
    one replica.

    Keras (and `one` above) launches one XLA program per step; inside our while-loop that
    launch costs more than a small step (measured on one CPU: 0.39 ms a step against 0.13 ms
    without XLA, a 2-layer MLP at 64 rows). XLA takes no iterator, so the group's batches
    are read first (outside XLA, as the loop reads them: up to N, fewer where the data end),
    stacked on a new axis and handed to one XLA program that runs the same step on each in
    turn in an XLA while-loop; the logs are the last step's. The program's input has N
    batches whatever the group holds (the last group's missing ones are copies of its last
    batch, never run): one XLA compilation per N. Where the batches have strings, shapes
    unknown to the program or more than `_GROUP_BYTES` in a group, the steps run one launch
    each, as before."""

    def __init__(self, model, step, strategy, reduce):
        self.model, self.step, self.strategy, self.reduce = model, step, strategy, reduce
        self.program = tf.function(self._run, jit_compile=True, reduce_retracing=True)
        self._concrete = {}
        self.function = tf.function(self._group)

    def takes(self, spec, n: int) -> bool:
        return self.strategy.num_replicas_in_sync == 1 and fits_one_program(spec, n)

    def __call__(self, iterator, n):
        return self.function(iterator, n)

    def run_group(self, iterator):
        """One element of a grouped pipeline (`tfdata.ArrayGroups`): the group's
        batches stacked already, read once, then run as one XLA program."""
        element = next(iterator)
        batches, count = element[tfdata.GROUP_BATCHES], element[tfdata.GROUP_STEPS]
        spec = tuple(tf.nest.flatten(iterator.element_spec))
        concrete = self._concrete.get(spec)
        if concrete is None:
            concrete = self._concrete[spec] = self.program.get_concrete_function(batches, count)
        return concrete(batches, count)

    def _group(self, iterator, n):
        first = next(iterator)  # Out of range here ends the epoch, as Keras expects.
        leaves = tf.nest.flatten(first)
        arrays = [
            tf.TensorArray(leaf.dtype, size=n, element_shape=leaf.shape).write(0, leaf)
            for leaf in leaves
        ]

        def more(i, optional, last, arrays):
            return tf.logical_and(i < n, optional.has_value())

        def read(i, optional, last, arrays):
            batch = tf.nest.flatten(optional.get_value())
            arrays = [a.write(i, leaf) for a, leaf in zip(arrays, batch)]
            optional = tf.cond(i + 1 < n, iterator.get_next_as_optional, lambda: optional)
            return i + 1, optional, batch, arrays

        start = (tf.constant(1), iterator.get_next_as_optional(), leaves, arrays)
        count, _, last, arrays = tf.while_loop(more, read, start)

        def fill(i, arrays):  # The slots of a short last group: never run.
            return i + 1, [a.write(i, leaf) for a, leaf in zip(arrays, last)]

        _, arrays = tf.while_loop(lambda i, arrays: i < n, fill, (count, arrays))
        stacked = tf.nest.pack_sequence_as(first, [a.stack() for a in arrays])
        return self.program(stacked, count)

    def _run(self, stacked, count):
        def one(i):
            data = tf.nest.map_structure(lambda t: t[i], stacked)
            outputs = self.strategy.run(self.step, args=(data,))
            return self.reduce(outputs, self.strategy, reduction="auto")

        outputs = one(0)

        def body(i, outputs):
            with guard.same_program(self.model):  # The same step, in the same program.
                return i + 1, one(i)

        return tf.while_loop(lambda i, outputs: i < count, body, (tf.constant(1), outputs))[1]
