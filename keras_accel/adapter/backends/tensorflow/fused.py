"""N train or test steps in one `tf.function` under a tf.distribute strategy."""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from keras_accel.adapter import guard
from keras_accel.adapter.backends.tensorflow.reduction import reduce_logs
from keras_accel.data import tfdata
from keras_accel.data.groups import GROUP_DATA, GROUP_REAL, GROUP_ROWS, GROUP_STEPS
from keras_accel.utils import library_internals


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
    # One replica: a group of steps is one program, XLA's or the graph's, whichever was
    # measured faster for this model (`GroupRunner`), not one launch per step.
    grouped = GroupRunner(model, kind, step, strategy, reduce)

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
        if is_group(getattr(iterator, "element_spec", None)):  # Groups (`Runtime.grouped`).
            return grouped.run_group(iterator)
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            # Batches from the host (`HostBatches`): up to N read, run as one program.
            return grouped.run_batches(iterator, n)
        if n == 1:  # A multi-worker step (`Runtime.make_function`): no loop, no look-ahead.
            return single(iterator)
        if jit and grouped.takes(iterator.element_spec, n):
            # One XLA program for the group's steps, or one launch per step (`steps`):
            # whichever was measured faster.
            return grouped.run_iterator(
                iterator, n, lambda: steps(iterator, tf.constant(n, tf.int32))
            )
        return steps(iterator, tf.constant(n, tf.int32))

    return function


def _with_shape(leaf, shape):
    if not isinstance(leaf, tf.Tensor) or shape is None or not leaf.shape.is_compatible_with(shape):
        return leaf
    leaf = tf.identity(leaf)
    leaf.set_shape(shape)
    return leaf


# Bytes of the batches a group holds at once on the device (`GroupRunner`): past this, a
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
    """Whether an iterator's elements are groups of batches (`groups.SlotGroups`)."""
    return isinstance(spec, dict) and GROUP_STEPS in spec


class GroupRunner:
    """Up to N steps as one program, on one replica: an XLA program or a graph one.

    Keras (and `one` above) launches one program per step; inside our while-loop that launch
    costs more than a small step (measured on one CPU: 0.39 ms a step with XLA against 0.13
    ms without, a 2-layer MLP at 64 rows). Here the group's batches come stacked on a new
    axis, and one program runs the same step on each in turn in a while-loop; the logs are
    the last step's. The program's input has N batches whatever the group holds (a short
    last group's missing ones are copies of its last batch, never run), and it runs the
    steps `begin` to `end` of them: one program per N, whatever part of a group it runs.

    Two programs run the same steps with the same numbers up to float rounding: the plain
    way, the step as the model compiles it (TensorFlow's graph, or one XLA launch per step
    for a model compiled with `jit_compile=True`, as Keras runs them) in a graph loop; and
    the compiled way, the whole group as one XLA program. Which one a host group runs is
    the model's `Choice` (`keras_accel.adapter.choice`): forced by the Accelerator's or the
    environment's setting, or measured on the model's own steps. Keras's "auto" leaves XLA
    off on CPUs, where XLA ran a small text classifier 5 times as fast as the graph; and
    XLA:CPU runs a convolution's gradient inside its while loop about 100 times as slowly
    as in a launch of its own, so that for a convolutional model the group program loses
    to one launch per step even under `jit_compile=True`.

    Groups come either from the host (`run_group`: in-memory arrays, a group gathered per
    call, `Runtime.grouped`), or, for a model compiled with `jit_compile=True` reading a
    data set, from the iterator (`__call__`: read first, outside XLA, as the loop reads
    them: up to N, fewer where the data end). Where the batches have strings, shapes unknown
    to the program or more than `_GROUP_BYTES` in a group, the steps run one launch each,
    as before."""

    def __init__(self, model, kind, step, strategy, reduce):
        from keras_accel.adapter import choice

        self.model_ref = weakref.ref(model) if model is not None else lambda: None
        self.kind, self.step, self.strategy, self.reduce = kind, step, strategy, reduce
        # The plain way runs each step as the model compiles it: with XLA, a launch each.
        self.launches = bool(getattr(model, "jit_compile", False))
        self._xla_step = None
        if self.launches:
            self._xla_step = tf.function(self._one_step, jit_compile=True, reduce_retracing=True)
        plain = "as one XLA launch per step" if self.launches else "as TensorFlow's graph"
        self.names = {choice.PLAIN: plain, choice.COMPILED: "as one XLA program per group"}
        self.programs = {
            choice.COMPILED: tf.function(self._run, jit_compile=True, reduce_retracing=True),
            choice.PLAIN: tf.function(self._run_plain, reduce_retracing=True),
        }
        self._concrete = {}
        self._choices = {}
        self._bounds = {}
        self.function = tf.function(self._group)

    def takes(self, spec, n: int) -> bool:
        return self.strategy.num_replicas_in_sync == 1 and fits_one_program(spec, n)

    def run_iterator(self, iterator, n: int, plain):
        """The next group of a data set's iterator (a model compiled with XLA): read into
        one XLA program, or run by `plain()` (a launch per step), as the `Choice` says.
        Either reads the group from the iterator; a unit is the whole group."""
        from keras_accel.adapter import choice as choices

        spec = ("iterator", repr(iterator.element_spec), n)
        choice = self._choices.get(spec)
        if choice is None:
            choice = self._choices[spec] = self._choice(spec)
        path, _ = choice.unit(n)
        timed = choice.timed()
        started = choices.clock() if timed else 0.0
        if path == choices.COMPILED:
            outputs = self.function(iterator, tf.constant(n, tf.int32))
        else:
            outputs = plain()
        if timed:
            _wait(outputs)
            choice.record(path, choices.clock() - started, n)
        return outputs

    def run_group(self, iterator):
        """One group from the host (`GroupedBatches`): its rows gathered from the arrays and
        run as one program (or, in a trial, as a few: `Choice.unit`)."""
        element = next(iterator)
        arrays = element[GROUP_DATA]
        rows, real = tf.constant(element[GROUP_ROWS]), tf.constant(element[GROUP_REAL])
        spec = (
            int(real.shape[0]),
            int(rows.shape[0]),
            tuple(_row_spec(t) for t in tf.nest.flatten(arrays)),
        )
        inputs = [t for t in tf.nest.flatten(arrays) if t is not None] + [rows, real]
        return self._run_units(
            spec, int(element[GROUP_STEPS]), lambda path: self._program(path, spec, arrays), inputs
        )

    def run_batches(self, iterator, n: int):
        """Up to `n` batches read from a Python iterator (`HostBatches`: steps of a call
        that are not whole passes), stacked on the host and run as one program; one
        launch per step where they do not fit one (`fits_one_program`)."""
        batches = [batch for _, batch in zip(range(n), iterator)]
        if not batches:
            raise StopIteration
        count = len(batches)
        if not fits_one_program(tf.nest.map_structure(_spec_of, batches[0]), n):
            # Too large for one program: each batch a group of one, as one launch each.
            outputs = None
            for batch in batches:
                outputs = self.run_batches(iter([batch]), 1)
            return outputs
        batches += [batches[-1]] * (n - count)  # Never run: one shape for every group.
        stacked = tf.nest.map_structure(
            lambda *leaves: tf.convert_to_tensor(np.stack(leaves)), *batches
        )
        flat = tf.nest.flatten(stacked)
        spec = ("stacked", tuple((tuple(t.shape), t.dtype.name) for t in flat))
        return self._run_units(
            spec, count, lambda path: self._stacked_program(path, spec, stacked), flat
        )

    def _run_units(self, spec, count: int, program_of, inputs: list):
        """A group's `count` steps, run by the programs `program_of(way)` on `inputs` (and
        each unit's first and last step), as the model's `Choice` for `spec` says."""
        from keras_accel.adapter import choice as choices

        choice = self._choices.get(spec)
        if choice is None:
            choice = self._choices[spec] = self._choice(spec)
        begin, outputs = 0, None
        while begin < count:
            path, steps = choice.unit(count - begin)
            program = program_of(path)
            end = begin + steps
            args = [*inputs, self._bound(begin), self._bound(end)]
            if not choice.timed():
                outputs = library_internals.tf_call_concrete(program, args)
            else:
                started = choices.clock()
                try:
                    outputs = library_internals.tf_call_concrete(program, args)
                    _wait(outputs)
                except tf.errors.OpError as error:
                    if path != choices.COMPILED or not _xla_refused(error):
                        raise
                    choice.failed(error)  # XLA refused the step: nothing ran.
                    continue
                choice.record(path, choices.clock() - started, steps)
            begin = end
        return outputs

    def _stacked_program(self, path, spec, stacked):
        concrete = self._concrete.get((path, spec))
        if concrete is None:
            concrete = self.programs[path].get_concrete_function(
                tf.nest.map_structure(tf.TensorSpec.from_tensor, stacked),
                tf.TensorSpec((), tf.int32),
                tf.TensorSpec((), tf.int32),
            )
            self._concrete[(path, spec)] = concrete
        return concrete

    def _bound(self, value: int):
        bound = self._bounds.get(value)
        if bound is None:
            bound = self._bounds[value] = tf.constant(value, tf.int32)
        return bound

    def _program(self, path, spec, arrays):
        """The concrete function of `path` that gathers a group's rows from arrays of any
        row count and runs its steps `begin` to `end`: traced once per array shapes (past
        the first axis) and group shape."""
        concrete = self._concrete.get((path, spec))
        if concrete is None:
            steps, positions, _ = spec
            program = self.programs[path]

            def gather_and_run(arrays, rows, real, begin, end):
                return program(tfdata.gather_group(arrays, rows, real, steps), begin, end)

            signature = (
                tf.nest.map_structure(_row_spec, arrays),
                tf.TensorSpec((positions,), tf.int64),
                tf.TensorSpec((steps,), tf.int32),
                tf.TensorSpec((), tf.int32),
                tf.TensorSpec((), tf.int32),
            )
            # No autograph: the gather has no Python control flow (the programs, as Keras's
            # step functions, keep theirs).
            concrete = tf.function(gather_and_run, autograph=False).get_concrete_function(
                *signature
            )
            self._concrete[(path, spec)] = concrete
        return concrete

    def _choice(self, spec):
        """The model's `Choice` for groups of `spec`: (steps, rows, the arrays' specs) of
        groups gathered in the program, ("stacked", the leaves' shapes and dtypes) of
        groups stacked on the host."""
        from keras_accel.adapter import choice, choice_cache
        from keras_accel.utils.printing import print_msg

        model = self.model_ref()
        if spec[0] == "iterator":
            signature = list(spec)
        elif spec[0] == "stacked":
            signature = ["stacked", [[list(shape), dtype] for shape, dtype in spec[1]]]
        else:
            steps, positions, arrays = spec
            described = [[list(s.shape), s.dtype.name] for s in arrays if s is not None]
            signature = [steps, positions, described]
        details = {"device": _device(model), "program": "group"}
        model_ref = self.model_ref
        return choice.Choice(
            "tensorflow",
            self.names,
            model,
            self.kind,
            fingerprint=lambda: choice_cache.fingerprint(
                model_ref(), self.kind, signature, details
            ),
            announce=print_msg,
            refuses=lambda: (
                None if supports_xla(model_ref()) else "Keras says the model does not support XLA"
            ),
            # The plain way is the step as the model compiles it, XLA or not: the model's
            # own `jit_compile` forces nothing here.
            model_decides=False,
            # A unit's first step runs before the program's loop: a timed unit of two
            # steps has one in the loop, where XLA:CPU can be far slower.
            slow_units=(1, 2),
        )

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
        return self.programs["compiled"](stacked, tf.constant(0), count)

    def _one_step(self, data):
        outputs = self.strategy.run(self.step, args=(data,))
        return self.reduce(outputs, self.strategy, reduction="auto")

    def _run_plain(self, stacked, begin, end):
        # A model compiled with XLA launches its step's program at each step, as Keras does.
        return self._run(stacked, begin, end, self._xla_step or self._one_step)

    def _run(self, stacked, begin, end, step=None):
        model = self.model_ref()
        step = step or self._one_step  # The XLA program's: inlined.

        def one(i):
            # A gather, not `t[i]`: XLA takes a strided slice's start as a constant, and
            # compiled the program again for every first step a unit began at.
            return step(tf.nest.map_structure(lambda t: tf.gather(t, i), stacked))

        outputs = one(begin)

        def body(i, outputs):
            with guard.same_program(model):  # The same step, in the same program.
                return i + 1, one(i)

        return tf.while_loop(lambda i, outputs: i < end, body, (begin + 1, outputs))[1]


def _spec_of(a):
    return tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype))


def _row_spec(t):
    """A spec of `t` for any number of rows (None stays None)."""
    if t is None:
        return None
    return tf.TensorSpec((None, *t.shape[1:]), t.dtype)


def supports_xla(model) -> bool:
    """Whether Keras lets `model` run with XLA (its public `jit_compile` setter checks: every
    layer's `supports_jit`, TensorFlow's op determinism, the platform), asked without
    changing the model."""
    import warnings

    if model is None:
        return False
    before = model.jit_compile
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras's "Model doesn't support jit_compile".
            model.jit_compile = True
        return model.jit_compile is True
    finally:
        model.jit_compile = before


def _wait(outputs) -> None:
    """Until the program's results exist (a GPU runs it after the call returns)."""
    for leaf in tf.nest.flatten(outputs):
        if isinstance(leaf, tf.Tensor):
            leaf.numpy()
            return


def _xla_refused(error) -> bool:
    """Whether `error` is XLA's refusal to compile the step (an op it cannot compile), not
    an error of the step itself."""
    text = str(error)
    return isinstance(error, (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)) and (
        "XLA" in text or "tf2xla" in text or "jit" in text
    )


def _device(model) -> str:
    """Where the model's steps run: its first variable's device."""
    variables = getattr(model, "variables", None) or ()
    return variables[0].value.device if variables else "default"
