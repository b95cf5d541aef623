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

from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.data.batching import element, map_structure


@dataclass(frozen=True)
class StackedGroup:
    """`count` batches as the step reads them, stacked on a new first axis."""

    batches: Any
    count: int


class ArrayGroupPasses(PaddedBatchesAdapter):
    """`batches` (`keras_accel.data.sources.ArrayBatches`) as a Keras data adapter whose JAX
    iterator yields one `StackedGroup` of `steps` batches per call (the epoch's last group
    fewer). Its epochs are `batches`' (`Accelerator.fit` sets and advances them)."""

    feeds = "the JAX trainer's grouped steps"

    def __init__(self, batches, steps: int):
        self.batches = batches
        self.steps = steps

    @property
    def num_batches(self):
        return len(self.batches)

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


# The keys of a group's element (`SlotGroups`).
GROUP_STEPS = "keras_accel_steps"
GROUP_BATCHES = "keras_accel_batches"


class SlotGroups:
    """The groups of `steps` batches of `batches` (`keras_accel.data.sources.ArrayBatches`)
    one program reads per call (TensorFlow, one device), epoch after epoch, made on the host
    when asked: no pipeline to build, no thread, nothing kept between calls.

    Each element is `{GROUP_STEPS: k, GROUP_BATCHES: b}`, `b` the group's padded batches as
    the step reads them (`element`, with the row mask), stacked on a new first axis of
    exactly `steps` slots, gathered in one `take` per array (`ArrayBatches.group`): the
    same rows, order, padding and mask as the batches one by one. An epoch's last group
    holds k < `steps`; its missing slots repeat its last batch and are never run, so every
    element has one shape. The rows are those of `batches.epoch` at each epoch's first
    group (`Accelerator.fit` sets it as each epoch begins)."""

    def __init__(self, batches, steps: int):
        self.batches = batches
        self.steps = steps
        self.groups_per_epoch = -(-len(batches) // steps)
        self._position = 0  # The next group's place in its epoch.
        self._epoch = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._position == 0:
            self._epoch = self.batches.epoch
        batches, total = self.batches, len(self.batches)
        first = self._position * self.steps
        count = min(self.steps, total - first)
        if batches.epoch != self._epoch:  # Moved on by the caller: its epoch from the start.
            self._epoch, first, count = batches.epoch, 0, min(self.steps, total)
            self._position = 0
        group = batches.group(first, count)
        if count < self.steps:  # Never run: copies of the last batch give every group one shape.
            group = map_structure(lambda a: _filled(a, self.steps), group)
        self._position += 1
        if self._position == self.groups_per_epoch:
            self._position = 0
        return {
            GROUP_STEPS: count,
            GROUP_BATCHES: element(group, True, None, batches.plan.static_rows),
        }


def _filled(array, slots: int):
    import numpy as np

    missing = slots - array.shape[0]
    return np.concatenate([array, np.repeat(array[-1:], missing, axis=0)], axis=0)
