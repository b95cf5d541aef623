"""torch: a single device; keras_accel's distribution is not supported on this backend."""

from __future__ import annotations

from keras_accel.adapter import runtime
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.data.pydataset import StaticBatchDataset


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    import torch

    if torch.cuda.is_available():
        return {"gpu": ["gpu:0"], "cpu": ["cpu:0"]}
    return {"cpu": ["cpu:0"]}


@STRATEGIES.builder("single", "torch", default=True)
def _single(plan: Plan, layout_map):
    return None  # The Accelerator runs every strategy as "single" on torch, with a warning.


class Runtime(runtime.Runtime):
    """One device: Keras builds torch models from the step's own data, at the first step,
    and places them itself."""

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
    return Runtime(plan, STRATEGIES.build(plan, "torch", layout_map))


def backend_versions() -> dict[str, str]:
    import keras
    import torch

    return {"torch": torch.__version__, "keras": keras.__version__}
