"""N train or test steps in one `tf.function` under a tf.distribute strategy."""

from __future__ import annotations

import tensorflow as tf

from keras_accel.adapter import guard
from keras_accel.adapter.backends.tensorflow.reduction import reduce_logs


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

    if model.jit_compile:  # As Keras compiles one step: with XLA where the model asks.
        one = tf.function(one, jit_compile=True, reduce_retracing=True)

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
        if n == 1:  # A multi-worker step (`Runtime.make_function`): no loop, no look-ahead.
            return single(iterator)
        return steps(iterator, tf.constant(n, tf.int32))

    return function


def _with_shape(leaf, shape):
    if not isinstance(leaf, tf.Tensor) or shape is None or not leaf.shape.is_compatible_with(shape):
        return leaf
    leaf = tf.identity(leaf)
    leaf.set_shape(shape)
    return leaf
