"""The batches a custom loop's steps take: one epoch of the Accelerator's static batches
(`LoopBatches`), placed by the backend's steps, single or grouped into `StepGroup`s of
`steps_per_execution` batches that one compiled call runs."""

from __future__ import annotations


class StepGroup:
    """Up to `steps_per_execution` consecutive batches that `train_step` or `test_step`
    runs in one compiled call (host-loop fusion). `len(group)` is how many batches it holds;
    the last group of an epoch may hold fewer, and runs the same program."""

    def __init__(self, payload, steps: int):
        self.payload = payload
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        return f"StepGroup(steps={self.steps})"


class LoopBatches:
    """One epoch of the Accelerator's static batches, ready for a loop's steps: single
    batches, or `StepGroup`s of `steps_per_execution` batches. `steps` is the loop's
    backend steps (`keras_accel.loop.backends`), which place the batches."""

    def __init__(
        self,
        loop,
        batches,
        training: bool,
        epoch: int,
        steps_per_execution: int,
        steps,
    ):
        self.loop = loop
        self.steps = steps
        self.source = batches
        self.training = training
        self.steps_per_execution = steps_per_execution
        if hasattr(batches, "epoch"):
            batches.epoch = epoch
        self.plan = batches.plan

    def __len__(self) -> int:
        """Iterations: batches, or groups of them when fused."""
        if self.plan.num_batches is None:
            raise TypeError(
                f"These batches have no length: {self.plan.describe()}. Iterate them (the "
                "epoch ends where the data ends), or pass a data set that knows its length."
            )
        return -(-self.plan.num_batches // self.steps_per_execution)

    def __iter__(self):
        if self.steps_per_execution > 1:
            return iter(self.steps.groups(self.source, self.training, self.steps_per_execution))
        return iter(self.steps.distributed(self.source, self.training))
