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
from keras_accel.data.batching import element


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
