"""JAX: `keras.distribution` device meshes (DataParallel, ModelParallel)."""

from __future__ import annotations

import contextlib

import jax
import keras
import numpy as np
from keras import distribution as kd
from keras import ops

from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import overrides_any_step
from keras_accel.adapter.strategies import Plan
from keras_accel.data.batching import flatten
from keras_accel.data.pydataset import StaticBatchDataset
from keras_accel.data.sources import ArrayBatches, PyDatasetBatches
from keras_accel.utils import keras_internals


def inventory(probe_tpu: bool = True) -> dict[str, list[str]]:
    # JAX finds a TPU by itself; `probe_tpu` is part of the contract for TF's sake.
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
        self._devices = {_jax_device(name) for name in devices}
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

    def model_misplaced(self, model) -> str | None:
        return None  # JAX places variables, not models: see `variable_misplaced`.

    def variable_misplaced(self, variable) -> str | None:
        """Why `variable` is not laid out over this runtime's devices, or None."""
        sharding = getattr(variable.value, "sharding", None)
        placed = set(sharding.device_set) if sharding is not None else set()
        if placed >= self._devices:
            return None
        return f"lives on {len(placed)} device(s)"

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        if first_batch is None:
            return
        # Keras builds a model symbolically from the first batch it reads; ours carries the
        # row mask, which only our step wrappers understand: build from the batch the
        # model's step sees instead.
        keras_internals.install_symbolic_build(
            patches, model, first_batch, overrides_a_step=overrides_any_step(model)
        )

    def row_count(self, row_mask):
        return ops.sum(row_mask)

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        if preprocess is None:
            _refuse_text(batches)
        if isinstance(batches, PyDatasetBatches) or (
            isinstance(batches, ArrayBatches) and preprocess is None
        ):
            return StaticBatchDataset(batches, carry_mask=carry_mask)
        # tf.data inputs, and keras-hub preprocessing (which runs in tf.data, as keras-hub's
        # own fit does on JAX): Keras's JAX trainer reads tf.data batches as numpy.
        from keras_accel.data import tfdata

        if isinstance(batches, ArrayBatches):
            return tfdata.array_pipeline(batches, carry_mask, preprocess)
        return batches.pipeline(carry_mask, preprocess)


def _refuse_text(batches) -> None:
    """JAX arrays hold numbers only: text must become numbers before the compiled step."""
    x = getattr(batches, "x", None)
    leaves = [leaf for leaf in flatten(x) if getattr(leaf, "dtype", None) is not None]
    text = [leaf for leaf in leaves if np.dtype(leaf.dtype).kind in "OUS"]
    if text:
        raise ValueError(
            f"KERAS_BACKEND=jax cannot feed text to a compiled model: JAX arrays hold numbers "
            f"only. Received: x with a {text[0].dtype} array of shape {text[0].shape}. Turn "
            "the text into numbers first: a keras-hub task with its preprocessor (which "
            "keras_accel runs in tf.data, as keras-hub does), or TextVectorization mapped over "
            "a tf.data.Dataset; or use KERAS_BACKEND=tensorflow, where a model may take "
            "strings."
        )


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
