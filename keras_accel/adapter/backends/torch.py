"""torch: a single device; keras_accel's distribution is not supported on this backend."""

from __future__ import annotations

import contextlib

from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.strategies import Plan
from keras_accel.data.pydataset import StaticBatchDataset


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    import torch

    if torch.cuda.is_available():
        return {"gpu": ["gpu:0"], "cpu": ["cpu:0"]}
    return {"cpu": ["cpu:0"]}


class Runtime:
    all_reduce_sum = None
    native = None

    def __init__(self, plan: Plan):
        self.plan = plan
        self.num_replicas = 1

    @contextlib.contextmanager
    def scope(self):
        yield

    def model_misplaced(self, model) -> str | None:
        return None

    def variable_misplaced(self, variable) -> str | None:
        return None

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        return None  # Keras builds torch models from the step's own data, at the first step.

    def row_count(self, row_mask):
        return ops.sum(row_mask)

    def own_files(self, batches):
        return None  # One process: nothing to share.

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        if preprocess is not None or not hasattr(batches, "batch"):
            raise ValueError(
                "On the torch backend keras_accel feeds numpy arrays and PyDatasets only. "
                f"Received: {type(batches).__name__}"
                + (" with a keras-hub preprocessor" if preprocess is not None else "")
                + ". Use KERAS_BACKEND=jax or KERAS_BACKEND=tensorflow."
            )
        return StaticBatchDataset(batches, carry_mask=carry_mask)


def build(plan: Plan, layout_map=None) -> Runtime:
    return Runtime(plan)


def backend_versions() -> dict[str, str]:
    import keras
    import torch

    return {"torch": torch.__version__, "keras": keras.__version__}
