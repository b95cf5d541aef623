"""The `model_parallel` strategy on torch: a `keras.distribution.LayoutMap` splits variables
over the processes (a one-axis mesh, "model"), as `DTensor`s that FSDP2 gathers for each
step; its builder and its runtime.

The layout rule is JAX's: a variable whose path a `LayoutMap` entry matches is split on the
dimension that entry names "model" (`keras.distribution.LayoutMap`: exact path, else the one
regex that matches it whole); one that no entry matches, or whose dimension the process
count does not divide (said once), stays whole, and so does every non-trainable one (see
`keras_accel.adapter.backends.torch.fsdp`). Each optimizer slot is split as its variable.
An entry that matches no variable of the model is an error naming it.

Every process runs the whole of every batch, as one process does (the mesh has no data
axis: `mesh_shape=(1, N)`): FSDP2 gathers the split weights for the forward pass and frees
them after the backward pass (all at once, as under `fsdp`), so each process holds 1/N of
what the map splits between steps; each process's gradients are those of the whole batch,
the same in every process, and FSDP2's reduce-scatter hands each its shard of them. The
computation itself is not split (no tensor parallelism): what it divides is the state held
between steps.

The model is sharded at the call's first step and whole again when the call ends, as under
`fsdp`.
"""

from __future__ import annotations

import dataclasses
import re

from keras_accel.adapter.backends.torch import process_group
from keras_accel.adapter.backends.torch.data_parallel import SameStart
from keras_accel.adapter.backends.torch.fsdp import install_sharding, note_whole, sharded_model
from keras_accel.adapter.backends.torch.rows import GlobalRowDraws
from keras_accel.adapter.backends.torch.runtime import Runtime
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.pipeline import hub_layout_map
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.utils import keras_internals

AXIS = "model"


@dataclasses.dataclass(frozen=True)
class ModelMesh:
    """What the builder makes: the processes' one-axis `DeviceMesh` ("model") and the
    user's `LayoutMap`."""

    mesh: object
    layout_map: object

    def split_dim(self, variable) -> int | None:
        """The dimension the map splits `variable` on over the mesh (None: kept whole)."""
        dim = self._named_dim(variable)
        return None if dim is None or variable.shape[dim] % self.mesh.size() else dim

    def _named_dim(self, variable) -> int | None:
        """The dimension the map names "model" for `variable` (None: none)."""
        layout = self.layout_map[variable.path]
        axes = tuple(getattr(layout, "axes", None) or ())
        dims = [d for d, axis in enumerate(axes) if axis == AXIS]
        return dims[0] if len(dims) == 1 and len(axes) == len(variable.shape) else None

    def check(self, model) -> None:
        """An entry of the map that matches none of the model's variables is an error
        naming it (a renamed layer would escape the map, held whole); a variable whose
        named dimension the process count does not divide is said once, kept whole."""
        paths = [v.path for v in model.weights]
        unmatched = [
            key
            for key in self.layout_map
            if not any(key == path or re.fullmatch(key, path) for path in paths)
        ]
        if unmatched:
            shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
            raise ValueError(
                f"On torch strategy='model_parallel' the LayoutMap's entries {unmatched} "
                f"match no variable of the model {model.name!r}: what they mean to split would "
                f"stay whole. Its variables: {shown}. Correct each entry (Keras matches a "
                "variable's exact path, else a regex that matches the whole path) or remove it."
            )
        size = self.mesh.size()
        note_whole(
            model,
            [v for v in model.weights if v.trainable and self.split_dim(v) != self._named_dim(v)],
            f"model_parallel keeps {{count}} weight(s) its LayoutMap names whole, the "
            f"dimension named {AXIS!r} not being a multiple of the process count ({size})",
        )


@STRATEGIES.builder("model_parallel", "torch", default=True)
def _model_parallel(plan: Plan, layout_map):
    """A one-axis `DeviceMesh` of the processes ("model"), with the user's `LayoutMap`."""
    import keras

    size = process_group.world()
    if isinstance(layout_map, type):  # A keras-hub class: the map its backbone ships.
        layout_map = _shipped(layout_map, size)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise ValueError(
            "On torch strategy='model_parallel' splits the variables a "
            "keras.distribution.LayoutMap names over the processes (its 'model' axis). "
            f"Received: layout_map={layout_map!r}. Pass Accelerator(strategy="
            "'model_parallel', layout_map=layout_map), its entries naming 'model' on the "
            "dimension to split, or a keras-hub model class whose backbone ships one "
            "(get_layout_map: GemmaBackbone, LlamaBackbone, ... or their tasks, e.g. "
            "GemmaCausalLM), or use strategy='fsdp' to split every variable."
        )
    if tuple(plan.mesh_shape) != (1, size):
        raise ValueError(
            f"On torch strategy='model_parallel' runs one model axis over the {size} "
            f"process{'es' if size > 1 else ''}: mesh_shape=(1, {size}). Received: "
            f"mesh_shape={tuple(plan.mesh_shape)}. Leave mesh_shape unset, or start one "
            "process per model shard (`keras-accel launch -n N`)."
        )
    if size == 1:
        return None
    return ModelMesh(process_group.mesh(AXIS), layout_map)


def _shipped(model_class, size: int):
    """The `LayoutMap` a keras-hub class ships (`pipeline.hub_layout_map`), made for a
    `(1, size)` mesh of the processes ("batch", "model"), as on JAX: its "model" entries
    split over the processes; the data axis, of one, splits nothing. The class itself
    where it ships none (refused by the caller, naming it)."""
    import keras

    mesh = keras.distribution.DeviceMesh(
        (1, size), ["batch", AXIS], devices=[f"cpu:{i}" for i in range(size)]
    )
    shipped = hub_layout_map(model_class, mesh)
    return model_class if shipped is None else shipped


@STRATEGIES.runtime("model_parallel", "torch", default=True)
class ModelParallelRuntime(Runtime):
    """Every process runs the whole batch on weights it holds a shard of between steps
    (see the module docstring)."""

    def install_steps(self, patches: Patches, model, training: bool) -> None:
        sharded = self._sharded(model)
        if training:
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                patches.set(optimizer, "apply", sharded.applying(optimizer.apply))
            GlobalRowDraws(1, 0).install(patches, model)
        # FSDP2's gathers run in its module hooks, outside a compiled step of ours.

    def install_outer(self, patches: Patches, model) -> None:
        super().install_outer(patches, model)
        # Keras 3.16 would wrap the model in DistributedDataParallel (an all-reduce of
        # gradients that FSDP2 reduce-scatters already, over parameters it has swapped) and
        # sum every metric variable over the processes, each of which ran the whole batch:
        # not during our calls.
        own_result = keras_internals.step_aside_from_keras_ddp(patches, model)
        if own_result is not None:
            patches.set(model, "get_metrics_result", own_result)
        install_sharding(patches, self._sharded(model))

    def _sharded(self, model):
        native = self.native
        return sharded_model(model, native.mesh, native.split_dim, False, native.check)

    def callbacks(self) -> list:
        return [SameStart()]  # Every process starts from the chief's variables.
