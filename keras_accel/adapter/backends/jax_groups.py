"""Steps on the device (JAX): N steps of `fit`, `evaluate` or `predict` in one compiled program.

Keras 3.15's JAX trainer runs `steps_per_execution = N` as a host loop: N dispatches of the
one-step program, each with its Python and its host-device round trip. Here the N batches
of a group go to one jitted program that stacks them and runs the model's own step over them
with `jax.lax.scan`: the step is traced once, so the compile time does not grow with N, and
the state (weights, optimizer, metrics, RNG seeds, BatchNormalization statistics) is carried
from step to step on the device exactly as N calls would carry it.

A group always has the program's length. A short group (the end of an epoch, an evaluation
of fewer steps than N) is filled with references to its last batch, and a `valid` flag per
slot says which are real: a filler slot's step is skipped (`lax.cond`), its state and logs
are the previous slot's. The program's length is the first group's N; a longer group runs
through it in parts, so a short group, a shorter or a longer evaluation compiles nothing.

`scan_steps` is the one implementation: `Accelerator.fit`/`evaluate`/`predict` use it
through `GroupedSteps` (Keras's `train_function(state, iterator)` contract), the custom
loop's `StepGroup`s through `keras_accel.loop.backends.jax`.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from keras import distribution as distribution_lib

from keras_accel.data.batching import same_rows
from keras_accel.data.groups import StackedGroup
from keras_accel.utils import keras_internals

KINDS = ("train", "test", "predict")


def scan_steps(
    step, outputs: bool = False, shapes_only=contextlib.nullcontext, no_outputs: bool = False
):
    """`(state, stacked, valid) -> (last outputs, state)`, or `(every slot's outputs,
    state)` with `outputs=True`, running `step(state, batch) -> (outputs, state)` over the
    leading axis of `stacked` in one `lax.scan`; slots where `valid` is False leave the
    state, and the carried outputs, as they were (their own outputs are zeros).

    The step is traced twice: once for the shapes of its outputs (the scan's carry needs
    them first), inside `shapes_only()`, and once as the scan's body; once with
    `no_outputs=True`, for a step whose outputs are `()` (the custom loop's)."""

    def run(state, stacked, valid):
        if no_outputs:
            zeros = ()
        else:
            first = jax.tree.map(lambda a: a[0], stacked)
            with shapes_only():
                shapes = jax.eval_shape(step, state, first)[0]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(carry, slot):
            state, last = carry
            batch, ok = slot

            def skip(state, batch):
                return (zeros if outputs else last), state

            result, state = jax.lax.cond(ok, step, skip, state, batch)
            return (state, last if outputs else result), (result if outputs else None)

        (state, last), every = jax.lax.scan(body, (state, zeros), (stacked, valid))
        return (every if outputs else last), state

    return run


class GroupedSteps:
    """A model's `train_function`, `test_function` or `predict_function` as Keras 3.15's
    JAX trainer calls it, `function(state, iterator) -> (logs or outputs, state)`, running
    the next `model.steps_per_execution` batches of `iterator` in one program.

    The iterator's batches are placed on the devices already (Keras's JAX epoch iterator,
    `keras_accel.data.ahead`); the program stacks them. Predictions come back as one batch
    of every slot's rows, a filler slot's row mask all 0, so the Accelerator cuts them with
    the padding. The step is the model's own (with the Accelerator's step wrapper), read at
    trace time."""

    NAMES = {
        "plain": "as one program call per step",
        "compiled": "as one scanned program per group",
    }
    # What a scanned group saves at most, a step: the host's work of one call of the step's
    # program (its Python, dispatch and state); the step itself is the same program. A
    # step so long that this cannot be `choice.MARGIN` of it is never scanned on trial.
    MOST_SAVED_S = 1e-3

    def __init__(self, model, kind: str, agree=None):
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
        self.model = model
        self.kind = kind
        self.agree = agree
        self.length = 0  # The compiled program's group length.
        self._compiled = None
        self._one = None  # One step per call: the plain way.
        self._choices = {}
        self._traced: set[str] = set()  # The ways whose programs were traced.
        # Keras 3.16's JAX epoch iterator yields each group stacked (its super batches).
        self.super_batches = keras_internals.keras_scans_steps()

    def _step(self, state, data):
        model = self.model
        if self.kind == "train":
            return model.train_step(state, data)
        if self.kind == "test":
            return model.test_step(state, data)
        outputs, non_trainable = model.predict_step(state, data)
        return outputs, (state[0], non_trainable)

    def _layout(self, state):
        # Under a distribution the state comes back in the layout it went in (the next call
        # compiles nothing), as Keras's own step does; on one device JAX keeps it where it
        # is by itself (explicit shardings there would commit the arrays, and the second
        # call, on committed ones, would compile again).
        if distribution_lib.distribution() is None:
            return None
        return (None, jax.tree.map(_sharding, state))

    def _program(self, state):
        from keras_accel.adapter.guard import same_program

        collect = self.kind == "predict"
        # The shapes' trace is part of this program: the recompile guard counts one.
        shapes_only = functools.partial(same_program, self.model)
        scan = scan_steps(self._step, outputs=collect, shapes_only=shapes_only)

        def program(state, stacked, valid):
            result, state = scan(state, stacked, valid)
            if collect:  # (n, rows, ...) -> (n * rows, ...): one batch of every slot's rows.
                result = jax.tree.map(lambda a: a.reshape((-1, *a.shape[2:])), result)
            return result, state

        # It replaces its input: XLA may reuse the buffers.
        return jax.jit(program, donate_argnums=0, out_shardings=self._layout(state))

    def __call__(self, state, iterator):
        n = max(int(getattr(self.model, "steps_per_execution", 1) or 1), 1)
        first = next(iterator)  # StopIteration here ends the epoch, as in Keras.
        if isinstance(first, StackedGroup):  # Gathered a group at a time (`data.groups`).
            group, real = first.batches, first.count
            batches = None
        elif self.super_batches and not keras_internals.is_partial_batch_list(first):
            # Keras 3.16 stacks the group itself (`super_batch_iterator`) and places it.
            group, real = first, _leading(first)
            batches = None
        else:
            # Keras 3.15 hands the iterator of single batches; 3.16 a short last group's.
            batches = list(first) if self.super_batches else [first]
            while len(batches) < n and not self.super_batches:
                try:
                    batches.append(next(iterator))
                except StopIteration:
                    break
            real = len(batches)
        if self._compiled is None:
            # One program per function: its length is the first group's N. A longer group
            # (an evaluation fusing more steps than the fit's validation did) runs through
            # it in parts, a shorter one with its empty slots skipped: never another program.
            self.length = max(n, real)
            self._compiled = self._program(state)
        results = []
        for start in range(0, real, self.length):
            count = min(self.length, real - start)
            if batches is not None:
                part = batches[start : start + count]
                stacked = None
            else:
                part = None
                stacked = group if count == real else _slots(group, start, count)
            state = self._run_part(state, stacked, part, count, results)
        if self.kind != "predict" or len(results) == 1:
            return results[-1], state
        # Predictions of every unit, in order: each unit's rows (empty or skipped slots'
        # rows cut later with the padding, their row mask 0).
        return jax.tree.map(lambda *parts: jnp.concatenate(parts), *results), state

    def _run_part(self, state, stacked, batches, count: int, results: list):
        """`count` steps of one part of a group (`stacked`, or the list `batches`), each
        unit the way the `Choice` says: scanned, or a program call per step."""
        from keras_accel.adapter import choice as choices
        from keras_accel.adapter.guard import same_program

        choice = self._choice(stacked if batches is None else batches[0], batches is None)
        begin = 0
        while begin < count:
            path, steps = choice.unit(count - begin)
            timed = choice.timed()
            started = choices.clock() if timed else 0.0
            end = begin + steps
            # The other way's program, traced for the measurement, is no recompile of the
            # user's: the recompile guard does not count it.
            planned = bool(self._traced) and path not in self._traced
            self._traced.add(path)
            with same_program(self.model) if planned else contextlib.nullcontext():
                if path == choices.COMPILED:
                    if stacked is None:
                        stacked = _stack(batches)
                    full = stacked
                    if count < self.length:  # Empty slots: copies of the last batch, skipped.
                        full = jax.tree.map(lambda a: _fill(a, self.length), stacked)
                    slots = np.arange(self.length)
                    valid = (slots >= begin) & (slots < end)
                    result, state = self._compiled(state, full, valid)
                    results.append(result)
                else:
                    for i in range(begin, end):
                        batch = batches[i] if batches is not None else _slot(stacked, i)
                        result, state = self._one_step(state)(state, batch)
                        results.append(result)
            if timed:
                jax.block_until_ready((results[-1], state))
                choice.record(path, choices.clock() - started, steps)
            begin = end
        return state

    def _one_step(self, state):
        if self._one is None:
            self._one = jax.jit(self._step, donate_argnums=0, out_shardings=self._layout(state))
        return self._one

    def _choice(self, example, stacked: bool):
        """The model's `Choice` for this kind's groups of `example`'s shapes."""
        from keras_accel.adapter import choice as choices
        from keras_accel.adapter import choice_cache
        from keras_accel.utils.printing import print_msg

        # The key: shapes and dtype objects (a dtype's name costs more than the lookup).
        shapes = tuple(
            (leaf.shape[1:] if stacked else leaf.shape, leaf.dtype)
            for leaf in jax.tree.leaves(example)
        )
        choice = self._choices.get(shapes)
        if choice is None:
            signature = [self.length, [[list(shape), str(dtype)] for shape, dtype in shapes]]
            details = {"program": "scan", "devices": jax.device_count()}
            model, kind = self.model, self.kind
            choice = self._choices[shapes] = choices.Choice(
                "jax",
                self.NAMES,
                model,
                kind,
                fingerprint=lambda: choice_cache.fingerprint(model, kind, signature, details),
                agree=self.agree,
                announce=print_msg,
                most_saved_s=self.MOST_SAVED_S,
                model_decides=False,
            )
        return choice


def _slots(group, start: int, count: int):
    return jax.tree.map(lambda a: a[start : start + count], group)


def _slot(stacked, index: int):
    return jax.tree.map(lambda a: a[index], stacked)


def _leading(stacked) -> int:
    return int(jax.tree.leaves(stacked)[0].shape[0])


def _stack(batches: list):
    """One array per leaf with the batches on a new leading axis: numpy on the host where
    the batches are numpy (one transfer into the program), else on the devices, where the
    batches lie (their batch axis keeps its layout, now axis 1)."""

    def stack(*leaves):
        if all(isinstance(leaf, np.ndarray) for leaf in leaves):
            return np.stack(leaves)
        return jnp.stack(leaves)

    # Batches of a stream that grew: some in larger buckets.
    return jax.tree.map(stack, *same_rows(batches))


def _fill(leaf, length: int):
    missing = length - leaf.shape[0]
    filler = leaf[-1:]
    if isinstance(leaf, np.ndarray):
        return np.concatenate([leaf, np.repeat(filler, missing, axis=0)])
    return jnp.concatenate([leaf, jnp.repeat(filler, missing, axis=0)])


def _sharding(leaf):
    return getattr(leaf, "sharding", None)
