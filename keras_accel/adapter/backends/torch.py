"""torch: a single device; keras_accel's distribution is not supported on this backend."""

from __future__ import annotations

import contextlib

from keras_accel.adapter.strategies import Plan
from keras_accel.data.pydataset import StaticBatchDataset


def inventory() -> dict[str, list[str]]:
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

    def check_model(self, model) -> None:
        return None

    def wrap(self, batches):
        return StaticBatchDataset(batches)


def build(plan: Plan, layout_map=None) -> Runtime:
    return Runtime(plan)


def backend_versions() -> dict[str, str]:
    import keras
    import torch

    return {"torch": torch.__version__, "keras": keras.__version__}
