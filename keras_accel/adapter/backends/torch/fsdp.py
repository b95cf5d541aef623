"""The `fsdp` strategy on torch: fully sharded data parallelism over processes, on torch's
own FSDP2 (`torch.distributed.fsdp.fully_shard`) and `DTensor`s on a one-axis
`DeviceMesh` of the processes; its builder and its runtime.

Data parallelism as `data_parallel` runs it (each process's rows of every global batch,
exact row counts, metrics, draws), except that each variable is held as this process's
shard during a call: the layout rule is JAX's (`keras_accel.adapter.sharding`): the
largest dimension the process count divides; a variable with none, and every
non-trainable one (BatchNormalization's moving statistics, which a layer assigns inside
its forward pass, where FSDP2 would drop the write), stays whole. FSDP2 gathers the split
weights for the forward pass and frees them after the backward pass: all of them at once,
as one group (`fully_shard` on the model alone: Keras keeps a Sequential's or a
Functional's layers out of torch's module tree), so a step's peak holds the whole weights
and gradients (docs/benchmarks.md, "Sharded state on torch"); the gradients reach each
process reduce-scattered (averaged) to its shard, and Keras's optimizer updates the shards
in place, its slots sharded alike.

The model is sharded at the call's first step (after Keras built it and its optimizer,
and `SameStart` gave every process the chief's values) and made whole again when the call
ends: between calls the user's model is plain Keras (`get_weights`, `save`). A backup taken
during the call (`BackupAndRestore`) writes each process's shards through DCP; a whole
value assigned to a split variable meanwhile (a mid-epoch resume's replay) is cut to this
process's shard (`keras_internals.read_value_through`).
"""

from __future__ import annotations

import functools
import weakref

from keras_accel.adapter.backends.torch import process_group
from keras_accel.adapter.backends.torch.collectives import average_gradients
from keras_accel.adapter.backends.torch.data_parallel import DataParallelRuntime
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.utils import keras_internals, library_internals
from keras_accel.utils.printing import print_msg


@STRATEGIES.builder("fsdp", "torch", default=True)
def _fsdp(plan: Plan, layout_map):
    """A one-axis `DeviceMesh` of the processes ("data")."""
    size = process_group.world()
    if layout_map is not None or plan.mesh_shape[1] != 1:
        raise ValueError(
            "On torch strategy='fsdp' splits every variable over the processes (a data axis "
            f"only). Received: mesh_shape={plan.mesh_shape}"
            f"{' and a layout_map' if layout_map is not None else ''}. Leave both unset, or "
            "use KERAS_BACKEND=jax for a (data, model) mesh with a LayoutMap."
        )
    if plan.num_replicas != size:
        raise ValueError(
            f"On torch fsdp runs one process per device: {size} process"
            f"{'es' if size > 1 else ''} in the process group, so devices={size}. Received: "
            f"{plan.num_replicas} devices. Start one process per device (`keras-accel "
            "launch -n N`, torchrun)."
        )
    if size == 1:
        return None
    return process_group.mesh("data")


@STRATEGIES.runtime("fsdp", "torch", default=True)
class FullyShardedRuntime(DataParallelRuntime):
    """Data parallelism whose variables and optimizer slots hold this process's shard
    during a call (see the module docstring)."""

    def install_compiled(self, patches: Patches, model) -> None:
        pass  # FSDP2's gathers run in its module hooks, outside a compiled step of ours.

    def install_gradients(self, patches: Patches, model, optimizer) -> None:
        # FSDP2 reduce-scatters the sharded variables' gradients in the backward pass;
        # `ShardedModel.applying` averages the whole ones.
        sharded = sharded_model(model, self.native, self.split_dim, check=self.check)
        patches.set(optimizer, "apply", sharded.applying(optimizer.apply))

    def install_outer(self, patches: Patches, model) -> None:
        super().install_outer(patches, model)
        install_sharding(
            patches, sharded_model(model, self.native, self.split_dim, check=self.check)
        )

    def split_dim(self, variable) -> int | None:
        return _split_dim(variable, self.native.size())

    def check(self, model) -> None:
        """Say once per model which weights stay whole (each costs its full size in every
        process): no dimension the process count divides."""
        size = self.native.size()
        whole = [v for v in model.weights if v.trainable and _split_dim(v, size) is None]
        note_whole(
            model,
            whole,
            f"fsdp keeps {{count}} weight(s) whole in every process, no dimension being a "
            f"multiple of the process count ({size})",
        )


def install_sharding(patches: Patches, sharded: ShardedModel) -> None:
    """The model sharded at the first step of the call, whole again when it ends."""
    model = sharded.model_ref()
    for kind in ("train", "test", "predict"):
        patches.set(model, f"{kind}_step", sharded.first_sharding(getattr(model, f"{kind}_step")))
    patches.add(sharded.unshard)


_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sharded_model(model, mesh, split_dim, average: bool = True, check=None) -> ShardedModel:
    """The model's `ShardedModel` on `mesh` (one per model and mesh)."""
    held = _SHARDED.get(model)
    if held is None or held.mesh is not mesh:
        held = _SHARDED[model] = ShardedModel(model, mesh, split_dim, average)
    held.split_dim, held.average, held.check = split_dim, average, check
    return held


_NOTED: weakref.WeakSet = weakref.WeakSet()


def note_whole(model, whole: list, what: str) -> None:
    """Say once per model, from the chief, which of its weights (`whole`) a sharding
    strategy keeps whole: `what` with "{count}" for their number, then their names."""
    if not whole or model in _NOTED or process_group.rank() != 0:
        return
    _NOTED.add(model)
    shown = ", ".join(f"{v.path} {tuple(v.shape)}" for v in whole[:5])
    more = f" and {len(whole) - 5} more" if len(whole) > 5 else ""
    print_msg(f"keras_accel: {what.format(count=len(whole))}: {shown}{more}.")


class ShardedModel:
    """One model's shards: made at the first step of a call (`first_sharding`), whole again
    at its end (`unshard`), and the optimizer's `apply` on them (`applying`).

    `split_dim(variable)`: the dimension a variable is split on over the mesh (None: kept
    whole). `average`: the whole variables' gradients averaged over the processes (data
    parallelism), else the same in every process already (model parallelism). `check`:
    called with the model, built, before it is sharded (a note, or an error that stops the
    call with nothing sharded).
    """

    def __init__(self, model, mesh, split_dim, average: bool = True):
        self.model_ref = weakref.ref(model)
        self.mesh = mesh
        self.size = mesh.size()
        self.split_dim = split_dim
        self.average = average
        self.check = None
        # While sharded: what `unshard` puts back (None: whole).
        self.state: dict | None = None
        self.applying_now = False

    def first_sharding(self, step):
        def run(*args):
            if self.state is None:
                self.shard()
            return step(*args)

        return run

    def applying(self, apply):
        """`apply` on the gradients FSDP2 reduce-scattered to this process's shards, the
        whole variables' averaged here; in its lists the whole ones are replicated
        DTensors (torch's foreach ops take no mix of DTensors and tensors)."""

        def apply_on_shards(grads, trainable_variables=None):
            from torch.distributed.tensor import DTensor, Replicate

            grads = list(grads)
            split = bool(self.state and self.state["sharded_params"])
            whole = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, DTensor)]
            averaged = [grads[i] for i in whole]
            if self.average:
                averaged = average_gradients(averaged)
            for i, g in zip(whole, averaged, strict=True):
                grads[i] = (
                    DTensor.from_local(g, self.mesh, [Replicate()], run_check=False) if split else g
                )
            self.applying_now = split
            try:
                return apply(grads, trainable_variables)
            finally:
                self.applying_now = False
                # FSDP2 adds each step's gradients into the shards' own; Keras's `zero_grad`
                # (after the forward pass) reaches the gathered weights' only.
                for param in self.state["sharded_params"] if self.state else ():
                    param.grad = None

        return apply_on_shards

    def shard(self) -> None:
        """`fully_shard` on the model, its variables reading their parameters from the
        modules (FSDP2 swaps shards and gathered weights there), the optimizer's slots of
        the split ones sharded alike."""
        import torch
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        model = self.model_ref()
        if self.check is not None:
            self.check(model)
        split, whole = {}, []
        for variable in model.weights:
            dim = self.split_dim(variable)
            if dim is None or not variable.trainable:
                whole.append(variable)
            else:
                split[id(keras_internals.raw_value(variable))] = (variable, dim)
        self.state = {"swapped": [], "sharded_params": [], "class": type(model)}
        if not split:
            return  # Nothing the process count divides: data parallelism as it is.
        # A layer registers its variables' tensors as torch parameters under their paths
        # when built; a variable given another tensor since (as a call of ours found) left
        # the old one registered, which FSDP2 would shard in its place: the current ones.
        current = {v.path: keras_internals.raw_value(v) for v in model.variables}
        homes = {}  # id(parameter) -> (its module's parameters, its name there).
        for module in model.modules():
            registered = library_internals.module_parameters(module)
            for name, param in list(registered.items()):
                if name in current and param is not current[name]:
                    registered[name] = param = current[name]
                if param is not None:
                    homes.setdefault(id(param), (registered, name))
        fully_shard(
            model,
            mesh=self.mesh,
            shard_placement_fn=lambda param: Shard(split[id(param)][1]),
            # Whole: every other registered tensor (a seed generator's state, a metric's).
            ignored_params={
                p for i, p in ((i, self._param(homes[i])) for i in homes) if i not in split
            }
            or None,
        )
        # A layer that is no torch submodule of the model (Keras keeps a Sequential's or a
        # Functional's layers in lists) registers its variables' tensors out of FSDP2's reach:
        # there the whole tensors would stay alive through the call. The shards in their
        # place (`unshard` registers the whole ones again).
        for params in keras_internals.layers_torch_params(model):
            registered = library_internals.module_parameters(params)
            for name, param in list(registered.items()):
                if param is not None and id(param) in split:
                    registered[name] = self._param(homes[id(param)])
        swapped = self.state["swapped"]  # (variable, its class, its own tensor or None)
        for variable, _ in split.values():
            registered, name = homes[id(keras_internals.raw_value(variable))]
            swapped.append((variable, type(variable), None))
            keras_internals.read_value_through(variable, functools.partial(registered.get, name))
        trainable_whole = [v for v in whole if v.trainable]
        for variable in trainable_whole:
            own = keras_internals.raw_value(variable)
            swapped.append((variable, type(variable), own))
            keras_internals.read_value_through(variable, self._replicated_in_apply(own))
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            split_ids = {id(v) for v, _ in split.values()}
            for slot, variable in _slots(
                optimizer, [v for v, _ in split.values()] + trainable_whole
            ):
                own = keras_internals.raw_value(slot)
                if id(variable) in split_ids:
                    # None: `unshard` makes it whole from the shards; the whole tensor is
                    # not kept through the call (it would hold the slot whole in memory).
                    swapped.append((slot, type(slot), None))
                    shard = distribute_tensor(own.detach(), self.mesh, variable.value.placements)
                    own = torch.nn.Parameter(shard, requires_grad=False)
                else:
                    swapped.append((slot, type(slot), own))
                keras_internals.read_value_through(slot, self._replicated_in_apply(own))
        self.state["sharded_params"] = [v.value for v, _ in split.values()]

    @staticmethod
    def _param(home):
        registered, name = home
        return registered[name]

    def _replicated_in_apply(self, own):
        """A reader of `own`: itself, except a tensor while the optimizer applies, a
        replicated DTensor over its own memory (updated in place)."""
        from torch.distributed.tensor import DTensor, Replicate

        def read():
            if self.applying_now and not isinstance(own, DTensor):
                return DTensor.from_local(own, self.mesh, [Replicate()], run_check=False)
            return own

        return read

    def unshard(self) -> None:
        """Every variable and slot whole again, the module plain (FSDP2 taken off), in every
        process (the gathers are collectives)."""
        state, model = self.state, self.model_ref()
        self.state = None
        if state is None or model is None or not state["sharded_params"]:
            return
        import torch
        from torch.distributed.tensor import DTensor

        values = []
        for variable, _, _ in state["swapped"]:
            value = keras_internals.raw_value(variable)  # Not applying: the tensor held.
            values.append(value.full_tensor() if isinstance(value, DTensor) else value)
        shards = {id(p) for p in state["sharded_params"]}
        library_internals.fsdp_remove(model, state["class"])
        for (variable, cls, own), value in zip(state["swapped"], values, strict=True):
            held = keras_internals.raw_value(variable)
            if own is None or isinstance(held, DTensor):  # A shard: a whole tensor again.
                own = torch.nn.Parameter(value.detach().clone(), requires_grad=variable.trainable)
            if id(held) in shards:  # A model variable: its modules register it again.
                for module in model.modules():
                    registered = library_internals.module_parameters(module)
                    for name, param in list(registered.items()):
                        if param is held:
                            registered[name] = own
            keras_internals.stop_reading_through(variable, cls, own)
        keras_internals.retrack_torch_params(model)


def _split_dim(variable, size: int) -> int | None:
    """The dimension `variable` is split on over `size` processes: the largest the count
    divides (JAX's rule, `keras_accel.adapter.sharding`), None: kept whole."""
    shape = tuple(variable.shape)
    dims = [d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


def _slots(optimizer, variables):
    """(slot, variable) for each optimizer slot made from one of `variables`: Keras names a
    slot `{its variable's path, "/" as "_"}_{name}` and gives it its variable's shape."""
    keys = {v.path.replace("/", "_") + "_": v for v in variables}
    for slot in optimizer.variables:
        matches = [k for k in keys if slot.name.startswith(k)]
        if matches:
            variable = keys[max(matches, key=len)]
            if tuple(slot.shape) == tuple(variable.shape):
                yield slot, variable
