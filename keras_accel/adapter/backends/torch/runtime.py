"""The torch base runtime: one process on its one device (`single`, and any strategy over
one process), Keras's steps as Keras's torch trainer runs them, N per host call, compiled
where measured faster (`compiled`).

The strategies over several processes subclass it, one module each, registered beside
their builders (`keras_accel.adapter.strategies.STRATEGIES.runtime`): `data_parallel`
(`keras_accel.adapter.backends.torch.data_parallel`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import keras

from keras_accel.adapter import runtime
from keras_accel.adapter.backends.torch import compiled
from keras_accel.adapter.backends.torch.process_group import rank
from keras_accel.adapter.backends.torch.rows import GlobalRowDraws
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import overrides_any_step
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.data.pydataset import StaticBatchDataset, stream
from keras_accel.data.sources import ArrayBatches, IterableBatches, PyDatasetBatches
from keras_accel.utils import keras_internals


@STRATEGIES.builder("single", "torch", default=True)
def _single(plan: Plan, layout_map):
    return None


@STRATEGIES.runtime("single", "torch", default=True)
class Runtime(runtime.Runtime):
    """One process, one device: nothing to make one training of; the base of every torch
    strategy's runtime.

    Attributes:
        rank: this process's rank in the process group (0 without one).
    """

    def __init__(self, plan: Plan, native=None):
        super().__init__(plan, native)
        self.rank = rank()

    def device_scope(self):
        return contextlib.nullcontext()  # Keras places tensors on this process's device.

    def scope(self):
        return contextlib.nullcontext()

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        if first_batch is not None:
            # Keras builds a model from the first batch it reads; ours carries the row mask,
            # which only our step wrappers understand: build from the batch the model's step
            # sees instead, drawing from torch's generator what Keras's read would draw.
            from keras_accel.data.torch_feed import draw_as_keras_reads

            keras_internals.install_symbolic_build(
                patches,
                model,
                first_batch,
                overrides_a_step=overrides_any_step(model),
                skipped_read=draw_as_keras_reads,
            )
        self.install_steps(patches, model, training)

    def install_steps(self, patches: Patches, model, training: bool) -> None:
        """What this runtime changes in the model's steps for one call (after the build)."""
        # A padded batch's draws are those of its real rows (Keras's random layers draw in
        # training, the user's own at every call).
        GlobalRowDraws(1, 0).install(patches, model)
        # One process: Keras's steps compiled, one program each, where measured faster.
        compiled.install(patches, model)

    def make_function(self, model, kind: str):
        """The call's N steps (`model.steps_per_execution`) one after the other in one host
        call, where Keras's torch trainer refuses N > 1; with N = 1, Keras's own function,
        except under `jit_compile=True`, where Keras's `torch.compile` would trace our eager
        wrappers around the compiled steps (`compiled`), which compile themselves.

        The steps are Keras's, run as Keras's loop runs them (with no host sync between
        them: the logs stay tensors), so the numbers are those of N = 1; what changes is
        that batch hooks fire once per N steps, as on JAX and TensorFlow (`fusion`)."""
        n = getattr(model, "steps_per_execution", 1) or 1
        is_compiled = getattr(model, "jit_compile", False) and kind in compiled.KINDS
        if n == 1 and not is_compiled:
            return None
        model_ref = weakref.ref(model)
        name = f"{kind}_step"

        def steps_on_data(data):
            step = getattr(model_ref(), name)
            if kind == "predict":
                return _concatenated([step(batch) for batch in data])
            logs = None
            for batch in data:
                logs = step(batch)
            return logs

        return steps_on_data

    def row_count(self, row_mask):
        import torch

        return torch.sum(row_mask.to(torch.float32)).reshape(1)[0] / self.num_replicas

    def process_rows(self, static_rows: int) -> slice | None:
        """This process's rows of each global batch of `static_rows` (None: all of them)."""
        return None

    # `own_files` and `own_rows`: the runtime's defaults (None). Each process reads a
    # file-backed pipeline or a Grain data set whole and keeps its rows of each batch: where
    # processes read their own files, the end of their data is agreed through JAX's
    # coordinator (`keras_accel.utils.process.EndAgreement`), which a torch run has not.

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        rows = self.process_rows(batches.plan.static_rows)
        own = getattr(batches, "own_files", None)
        if own is not None and carry_mask:
            from keras_accel.data.grain import GrainPasses

            return GrainPasses(own.with_preprocess(preprocess), carry_mask=True)
        if preprocess is not None:
            raise ValueError(
                "On the torch backend keras_accel feeds numbers: a keras-hub preprocessor "
                "runs in tf.data, which Keras's torch trainer reads but keras_accel does not "
                "route there yet. Received: a model with a preprocessor. Preprocess first "
                "(`preprocessor(x)` into arrays), or use KERAS_BACKEND=jax or tensorflow."
            )
        if isinstance(batches, IterableBatches):
            return stream(batches, carry_mask=carry_mask, rows=rows)
        if isinstance(batches, ArrayBatches):
            # In-memory arrays: gathered and converted in the trainer's thread (torch_feed).
            from keras_accel.data.torch_feed import TorchBatches

            return TorchBatches(StaticBatchDataset(batches, carry_mask=carry_mask, rows=rows))
        if isinstance(batches, PyDatasetBatches):
            # A user's PyDataset: read in Keras's worker thread, as Keras reads it.
            from keras_accel.data.torch_feed import KerasReadDataset

            return KerasReadDataset(batches, carry_mask=carry_mask, rows=rows)
        # tf.data inputs: Keras's torch trainer reads them as torch tensors.
        from keras_accel.data import tfdata

        pipeline = batches.pipeline(carry_mask, preprocess)
        return pipeline if rows is None else tfdata.take_rows(pipeline, rows)


# Keras's EpochIterator reads a group of N batches with `__next__` on torch (its other
# trainers read the iterator inside their step function) and warns "Your input ran out of
# data" whenever the data ends inside a group: at every known-length epoch whose last group
# is shorter than N, which is by design (keras.src.trainers.epoch_iterator, 3.15).
_RAN_OUT = r"Your input ran out of data"


def quiet_short_groups(patches) -> None:
    """For the duration of `patches`: no "ran out of data" warning from Keras's epoch
    iterator (a fused call's last group; see `_RAN_OUT`)."""
    warnings.filterwarnings("ignore", message=_RAN_OUT, module=r"keras\.src\.trainers")
    added = warnings.filters[0]

    def remove():
        # An "ignore" leaves nothing in the warnings registries: removing it is enough.
        if added in warnings.filters:
            warnings.filters.remove(added)

    patches.add(remove)


def _concatenated(outputs: list):
    """N steps' predictions as one group's (Keras's loop appends a call's outputs)."""
    if len(outputs) == 1:
        return outputs[0]
    import torch

    return keras.tree.map_structure(lambda *parts: torch.cat(parts, dim=0), *outputs)
