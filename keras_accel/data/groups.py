"""Groups of in-memory batches, gathered a group at a time (JAX, one CPU device).

Keras's fit loop calls the step function once per N steps, and ours (`keras_accel.adapter.
backends.jax_groups.GroupedSteps`) then reads N batches from the iterator and stacks them.
On one CPU device each of those batches came through Keras's `PyDataset` adapter (its
queue, its thread, one `take` and one padding per batch) and the stack copied them once
more. Here the iterator yields a whole group (a `StackedGroup`; on Keras 3.16, which stacks
groups itself, its stacked arrays), its batches gathered from the arrays in one `take` per
array (`ArrayBatches.group`): the same arrays, rows and order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.data.batching import element


@dataclass(frozen=True)
class StackedGroup:
    """`count` batches as the step reads them, stacked on a new first axis."""

    batches: Any
    count: int


class ArrayGroupPasses(PaddedBatchesAdapter):
    """`batches` (`keras_accel.data.array_batches.ArrayBatches`) as a Keras data adapter whose JAX
    iterator yields one `StackedGroup` of `steps` batches per call (the epoch's last group
    fewer). Its epochs are `batches`' (`Accelerator.fit` sets and advances them)."""

    feeds = "the JAX trainer's grouped steps"

    def __init__(self, batches, steps: int):
        self.batches = batches
        self.steps = steps

    @property
    def num_batches(self):
        return len(self.batches)

    @property
    def keras_accel_indexed_batches(self):
        # Read by position in the epoch (`len`, `group`): they can begin it late.
        return self.batches

    def keras_accel_first_batch(self):
        # What `Accelerator` builds the model from (`_first_batch`).
        return self.batches.batch(0)

    def get_jax_iterator(self, super_batch=None):
        # Keras 3.16 asks for groups of `super_batch` (the model's steps_per_execution, our
        # `steps`) and places each element itself (a tree of arrays): the stacked batches
        # as they are, which our step function takes as a group of their leading length.
        # Keras 3.15 passes each element on untouched: a `StackedGroup`.
        total, static = len(self.batches), self.batches.plan.static_rows
        for first in range(0, total, self.steps):
            count = min(self.steps, total - first)
            stacked = element(self.batches.group(first, count), True, None, static)
            yield stacked if super_batch else StackedGroup(stacked, count)


# The keys of a group's element (`RowGroups`).
GROUP_STEPS = "keras_accel_steps"
GROUP_ROWS = "keras_accel_rows"
GROUP_REAL = "keras_accel_real"
GROUP_DATA = "keras_accel_data"


class RowGroups:
    """Which rows of the arrays each group of `steps` batches of `batches`
    (`keras_accel.data.array_batches.ArrayBatches`) holds, epoch after epoch, for a program that
    gathers them itself from arrays it holds whole (TensorFlow, one device): per group
    only the rows' positions cross from the host, no batch is copied there, no pipeline is
    built.

    Each element is `{GROUP_STEPS: k, GROUP_ROWS: positions, GROUP_REAL: real}`: the
    positions (int64, `steps` x the static batch size, flattened) of the rows of the
    group's padded batches in the epoch's order (`ArrayBatches.epoch_indices`, the order of
    every backend), and each slot's real rows (int32, `steps`); a padding row's position is
    its batch's last real row's, weighted and masked out (`keras_accel.data.tfdata.
    gather_group`). An epoch's last
    group holds k < `steps` batches; its missing slots have no real rows and are never
    run, so every element has one shape. The rows are those of `batches.epoch` at each
    epoch's first group (`Accelerator.fit` sets it as each epoch begins)."""

    def __init__(self, batches, steps: int):
        self.batches = batches
        self.steps = steps
        self.groups_per_epoch = -(-len(batches) // steps)
        self._position = 0  # The next group's place in its epoch.
        self._epoch = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batches = self.batches
        if self._position == 0 or batches.epoch != self._epoch:
            # An epoch's first group, or an epoch moved on by the caller: from its start.
            self._epoch, self._position = batches.epoch, 0
        plan, steps = batches.plan, self.steps
        first = self._position * steps
        count = min(steps, len(batches) - first)
        rows, static = plan.batch_size, plan.static_rows
        order = batches.epoch_indices(self._epoch)
        real = np.zeros(steps, np.int32)
        real[:count] = plan.real_rows[first : first + count]
        start = first * rows
        if count == steps and rows == static and (real == static).all():
            positions = np.asarray(order[start : start + count * rows], np.int64)
        else:  # A padded batch in the group, or missing slots.
            # A padding row reads its batch's last real row (`keras_accel.data.batching.
            # pad_rows` says why), an empty slot's the data's first; weight and mask 0.
            positions = np.full((steps, static), order[0], np.int64)
            for slot in range(count):
                begin = start + slot * rows
                positions[slot, : real[slot]] = order[begin : begin + real[slot]]
                positions[slot, real[slot] :] = order[begin + real[slot] - 1]
            positions = positions.reshape(-1)
        self._position += 1
        if self._position == self.groups_per_epoch:
            self._position = 0
        return {GROUP_STEPS: count, GROUP_ROWS: positions, GROUP_REAL: real}
