"""What `model.fit` takes on any backend, from batches read in Python: a `keras.utils.PyDataset`
over indexed batches (arrays, a user's PyDataset), a generator over streamed ones (a user's
generator, a Grain data set)."""

from __future__ import annotations

import keras

from keras_accel.data.batching import element


class StaticBatchDataset(keras.utils.PyDataset):
    """Serves `batches.batch(i)`; `on_epoch_end` advances the batches to the next epoch.

    With `carry_mask=True` (what the Accelerator feeds its own step wrappers) a batch is
    `(x, y, (sample_weight, row_mask))` (`(x, row_mask)` without targets), the user's weights
    unscaled; with False (`Accelerator.dataset`, for a plain `model.fit`) it is Keras's
    `(x, y, sample_weight)`, padding rows weighted 0 and real rows scaled (or `(x,)`).

    `rows` (a slice of each global batch) serves only this process's rows of a multi-process
    run: every process computes the same global batch (same order, same padding), then keeps
    the rows that its devices hold (batches of arrays, `reads_rows`, read only those). A
    user's PyDataset without a length gives one without a length (`num_batches` None:
    Keras's infinite PyDataset, ended by `steps_per_epoch`).
    """

    def __init__(self, batches, carry_mask: bool = True, workers: int = 1, rows=None):
        # One worker: Keras reads the batches in its own thread, in order, as it reads a
        # user's PyDataset (on JAX, `keras_accel.data.ahead` gathers one batch ahead).
        super().__init__(workers=workers, use_multiprocessing=False, max_queue_size=4)
        self.batches = batches
        self.carry_mask = carry_mask
        self.rows = rows

    @property
    def keras_accel_indexed_batches(self):
        # Read by position in the epoch: they can begin it late (`keras_accel.data.start`).
        return self.batches

    @property
    def num_batches(self):
        if hasattr(self.batches, "num_batches"):  # None: a PyDataset without a length.
            return self.batches.num_batches
        return len(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int):
        plan = self.batches.plan
        if hasattr(plan, "cut_of"):  # A PyDataset: a batch's rows are known as it is read.
            batch = self.batches.batch(index, scale=not self.carry_mask)
            return _marked(batch, plan, self.carry_mask, self.rows)
        # The batch's place in the whole epoch, which may have begun late (a resume,
        # `keras_accel.data.start`): the plan's facts are about that batch.
        place = index + getattr(self.batches, "skipped", 0)
        # The real rows the step cuts a marked batch to (`BatchPlan.cut_rows`), or None.
        cut = plan.cut_rows(place)
        if self.rows is not None and getattr(plan, "replicated", lambda index: False)(place):
            # Every process reads this batch whole: its step runs on all of its real rows in
            # every process, as one device runs it (`remainder="replicate"`).
            batch = self.batches.batch(index, scale=not self.carry_mask)
            return element(batch, self.carry_mask, None, cut=cut)
        if self.rows is not None and getattr(self.batches, "reads_rows", False):
            # Arrays: only this process's rows are read (`ArrayBatches.batch`), not the
            # other processes' too.
            batch = self.batches.batch(index, scale=not self.carry_mask, rows=self.rows)
            return element(batch, self.carry_mask, None, cut=cut)
        batch = self.batches.batch(index, scale=not self.carry_mask)
        return element(batch, self.carry_mask, self.rows, self.batches.plan.static_rows, cut)

    def on_epoch_end(self) -> None:
        self.batches.on_epoch_end()


def stream(batches, carry_mask: bool = True, rows=None):
    """A Python generator over `batches.batches()` (`keras_accel.data.sources.
    IterableBatches`), which Keras's `fit` reads as it reads a user's generator: epoch after
    epoch from where it stopped, ended by `steps_per_epoch` or by the data's end. A
    re-iterable stream (Grain) is a Keras data adapter instead, a fresh pass every epoch
    (`keras_accel.data.grain`)."""
    if batches.reiterable:
        from keras_accel.data.grain import GrainPasses

        return GrainPasses(batches, carry_mask=carry_mask, rows=rows)

    def generate():
        for batch in batches.batches(scale=not carry_mask):
            yield _marked(batch, batches.plan, carry_mask, rows)

    return generate()


def _marked(batch, plan, carry_mask: bool, rows):
    """A stream's padded `batch` as this process's step reads it, marked with the real rows
    its step cuts it to where the plan says so (`StreamPlan.cut_of`: "cut", "replicate"):
    under "replicate" a batch with padding is read whole in every process, as the
    replicated batch of arrays is (`StaticBatchDataset.__getitem__`)."""
    cut = plan.cut_of(batch)
    if cut and plan.remainder == "replicate":
        return element(batch, carry_mask, None, cut=cut)
    return element(batch, carry_mask, rows, plan.static_rows, cut)
