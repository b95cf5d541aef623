"""JAX: `keras.distribution` device meshes (DataParallel, ModelParallel)."""

from __future__ import annotations

import contextlib

import jax
import keras
from keras import distribution as kd

from keras_accel.adapter.strategies import Plan
from keras_accel.data.pydataset import StaticBatchDataset


def inventory() -> dict[str, list[str]]:
    found = {}
    for platform in ("tpu", "gpu", "cpu"):
        try:
            devices = jax.devices(platform)
        except RuntimeError:  # JAX raises when a platform has no backend here.
            continue
        if devices:
            found[platform] = [f"{platform}:{d.id}" for d in devices]
    return found


def _jax_device(name: str):
    platform, index = name.split(":")
    return next(d for d in jax.devices(platform) if d.id == int(index))


class Runtime:
    """A `keras.distribution` Distribution (or a single device) built from a `Plan`."""

    all_reduce_sum = None  # jit programs are global-view: sums already span every replica.

    def __init__(self, plan: Plan, layout_map=None):
        self.plan = plan
        self.num_replicas = plan.num_replicas
        devices = list(plan.devices)
        if plan.strategy == "single":
            self.native = None
        elif plan.strategy == "model_parallel":
            mesh = kd.DeviceMesh(plan.mesh_shape, ["batch", "model"], devices)
            layout_map = layout_map if layout_map is not None else default_layout_map(mesh)
            if layout_map.device_mesh is not mesh:
                layout_map = _rebind(layout_map, mesh)
            self.native = kd.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        else:
            self.native = kd.DataParallel(devices=devices)

    @contextlib.contextmanager
    def scope(self):
        if self.native is None:
            with jax.default_device(_jax_device(self.plan.devices[0])):
                yield
        else:
            with self.native.scope():
                yield

    def check_model(self, model) -> None:
        if self.native is None or not model.weights:
            return
        expected = {_jax_device(name) for name in self.plan.devices}
        for variable in model.weights:
            placed = set(variable.value.sharding.device_set)
            if not placed >= expected:
                raise RuntimeError(
                    f"The model was built outside `acc.scope()`: its variable "
                    f"{variable.path!r} lives on {len(placed)} device(s), but this "
                    f"Accelerator spreads work over {len(expected)}. Build and compile it "
                    "inside `with acc.scope():` so its variables are laid out over the mesh."
                )

    def wrap(self, batches):
        return StaticBatchDataset(batches)


def default_layout_map(mesh):
    """Shard the output axis of every Dense kernel over the "model" axis; replicate the rest."""
    layout_map = kd.LayoutMap(mesh)
    layout_map[r".*dense.*kernel"] = (None, "model")
    layout_map[r".*dense.*bias"] = ("model",)
    return layout_map


def _rebind(layout_map, mesh):
    rebound = kd.LayoutMap(mesh)
    for key in layout_map:
        rebound[key] = layout_map[key].axes
    return rebound


def build(plan: Plan, layout_map=None) -> Runtime:
    if layout_map is not None and plan.strategy != "model_parallel":
        raise ValueError(
            f"layout_map is only used by strategy='model_parallel'. Received: "
            f"strategy={plan.strategy!r} with a layout_map."
        )
    return Runtime(plan, layout_map)


def backend_versions() -> dict[str, str]:
    return {"jax": jax.__version__, "keras": keras.__version__}
