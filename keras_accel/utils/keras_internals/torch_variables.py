"""Keras's torch variables and layers: a variable's tensor (`Variable._value`, which Keras's
own `value` reads, autocast included) and the torch parameters each layer registers
(`TorchLayer._track_variables`, into `_torch_params`).

`fsdp` on torch (`keras_accel.adapter.backends.torch.fsdp`) makes a variable read its
tensor from where FSDP2 keeps it (a shard between steps, the gathered weight inside a
layer's forward pass): its class becomes a subclass whose `_value` is a property, so
that every Keras path that reads the variable reads that, and is put back after the call;
a whole value assigned to it meanwhile (a restored backup) is cut to this process's shard.
"""

from __future__ import annotations

from collections.abc import Callable

from keras_accel.utils.keras_internals.layers import flatten_layers
from keras_accel.utils.keras_internals.lookup import require

# Instance attributes, set when a variable is made and when a torch layer tracks its
# variables; read on the objects themselves (`require`).
VARIABLE_VALUE = "a torch variable's tensor"
TORCH_PARAMS = "the torch parameters a layer registers for its variables"
VARIABLE_ASSIGN = "how a torch variable writes an assigned value into its tensor"

_READERS: dict = {}


def read_value_through(variable, read: Callable) -> None:
    """From now on `variable`'s tensor is `read()` (whatever it returns at each read)."""
    require(variable, "_value", VARIABLE_VALUE)
    require(variable, "_direct_assign", VARIABLE_ASSIGN)  # A whole value: this shard of it.
    base = type(variable)
    if base not in _READERS:

        class ReadThrough(base):
            @property
            def _value(self):
                return self.__dict__["keras_accel_read"]()

            @_value.setter
            def _value(self, value):
                raise AttributeError(
                    "keras_accel: this variable is sharded for the call (fsdp); its value "
                    "is set by the strategy, and whole again when the call ends."
                )

            def _direct_assign(self, value):
                super()._direct_assign(_as_held(self, value))

            def numpy(self):
                _refuse_a_split_read(self)
                return super().numpy()

            def __array__(self, dtype=None):
                _refuse_a_split_read(self)
                return super().__array__(dtype)

        ReadThrough.__name__ = ReadThrough.__qualname__ = base.__name__
        _READERS[base] = ReadThrough
    variable.__dict__["keras_accel_read"] = read
    variable.__class__ = _READERS[base]
    variable.__dict__.pop("_value", None)


def _as_held(variable, value):
    """`value`, assigned whole to a variable split over the processes (a restore, the
    mid-epoch resume's replay, a callback's `assign`): this process's shard of it, cut
    here (the value is the same in every process, so no collective), as a DTensor laid
    out as the variable's own."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    held = variable.__dict__["keras_accel_read"]()
    if not isinstance(held, DTensor) or isinstance(value, DTensor):
        return value
    value = value.detach().to(held.device)
    return distribute_tensor(value, held.device_mesh, held.placements, src_data_rank=None)


def _refuse_a_split_read(variable) -> None:
    """A split variable cannot be read whole in one process (the gather is a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(variable.__dict__["keras_accel_read"](), DTensor):
        raise ValueError(
            f"Variable {variable.path} is split over the processes during this call "
            "(strategy='fsdp' on torch): no process holds it whole to read as numpy. "
            "Received: a read of its value inside the call (a callback such as "
            "ModelCheckpoint?). Read the weights after the call (model.get_weights(), "
            "model.save()), where the model is whole again, or use strategy='data_parallel'."
        )


def stop_reading_through(variable, base: type, value) -> None:
    """`variable` as Keras made it (class `base`), holding `value`."""
    variable.__dict__.pop("keras_accel_read", None)
    variable.__class__ = base
    variable.__dict__["_value"] = value


def raw_value(variable):
    """The tensor `variable` holds (`_value`, before Keras's autocast)."""
    return require(variable, "_value", VARIABLE_VALUE)


def layers_torch_params(model) -> list:
    """The torch module (a `ParameterDict`) in which each built layer of `model` registers
    its variables' tensors. Keras keeps a `Sequential`'s or `Functional`'s layers in lists,
    not as torch submodules: their registrations are outside `model.modules()`."""
    return [
        require(layer, "_torch_params", TORCH_PARAMS)
        for layer in flatten_layers(model, include_self=True)
        if hasattr(layer, "_torch_params")  # Tracked already (a built layer).
    ]


def retrack_torch_params(model) -> None:
    """Every layer of `model` registers its variables' current tensors as its torch
    parameters again (as Keras's own `_track_variables` does when a layer is built)."""
    for layer in flatten_layers(model, include_self=True):
        if hasattr(layer, "_torch_params"):  # Tracked already (a built layer).
            require(layer, "_track_variables", TORCH_PARAMS)()
