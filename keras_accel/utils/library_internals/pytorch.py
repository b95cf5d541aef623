"""torch's: a tensor's in-place version counter, and torch.distributed.checkpoint's (DCP's)
one-process saver, its fsspec storage writer and reader, and the private classes its
`.metadata` pickles (for the allow-list that reads it without running code)."""

from __future__ import annotations

from keras_accel.utils.library_internals.lookup import Internal, find, find_optional, missing

_TENSOR_VERSION = Internal(
    "torch",
    "torch.Tensor",
    "_version",
    "the in-place version counter autograd checks: the only way to see that a gradient "
    "changed after the backward pass sent it",
)
_SAVE_STATE_DICT = Internal(
    "torch",
    "torch.distributed.checkpoint.state_dict_saver",
    "_save_state_dict",
    "DCP's saver without the warning with which dcp.save says it saves in one process "
    "(in a background thread, no filter of ours can hold it back under -W error)",
    fallback="dcp.save, which warns",
)
_FSSPEC_WRITER = Internal(
    "torch",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "FsspecWriter",
    "DCP checkpoints on remote file systems (gs://, s3://): not exported by "
    "torch.distributed.checkpoint, named as torch's own tests and torchtitan import it",
)
_FSSPEC_READER = Internal(
    "torch",
    "torch.distributed.checkpoint._fsspec_filesystem",
    "FsspecReader",
    "restoring DCP checkpoints from remote file systems (as FsspecWriter)",
)
# What DCP's `.metadata` pickle names besides its public dataclasses: each entry of its
# index (`_StorageInfo`), a tensor's memory format (`_MEM_FORMAT_ENCODING`, an Enum) and
# its layout (`_get_layout`, which looks a layout up by its name).
_DCP_STORAGE_INFO = Internal(
    "torch",
    "torch.distributed.checkpoint.filesystem",
    "_StorageInfo",
    "where each value lies in DCP's files: a class DCP's `.metadata` pickles, allowed by "
    "the unpickler that reads it without running code",
)
_DCP_MEMORY_FORMAT = Internal(
    "torch",
    "torch.distributed.checkpoint.metadata",
    "_MEM_FORMAT_ENCODING",
    "a tensor's memory format in DCP's `.metadata` (allowed as _StorageInfo)",
)
_TORCH_GET_LAYOUT = Internal(
    "torch",
    "torch.serialization",
    "_get_layout",
    "how a pickle names a tensor's layout (torch.strided), in DCP's `.metadata` (allowed "
    "as _StorageInfo)",
)
INTERNALS = [
    _TENSOR_VERSION,
    _SAVE_STATE_DICT,
    _FSSPEC_WRITER,
    _FSSPEC_READER,
    _DCP_STORAGE_INFO,
    _DCP_MEMORY_FORMAT,
    _TORCH_GET_LAYOUT,
]


def tensor_version(tensor) -> int:
    """A torch tensor's in-place version counter (`Tensor._version`): it grows with every
    in-place change, as autograd checks."""
    try:
        return tensor._version
    except AttributeError:
        raise missing(_TENSOR_VERSION) from None


def dcp_save_in_one_process(state: dict, writer) -> None:
    """`torch.distributed.checkpoint.save(state, storage_writer=writer, no_dist=True)`
    without its one-process UserWarning (DCP's own saver behind `dcp.save`)."""
    saver = find_optional(_SAVE_STATE_DICT)
    if saver is None:  # pragma: no cover - a torch that moved it
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=writer, no_dist=True)
        return
    saver(state_dict=state, storage_writer=writer, no_dist=True)


def dcp_fsspec_writer(path: str):
    """DCP's storage writer for a remote (fsspec) path."""
    return find(_FSSPEC_WRITER)(path)


def dcp_fsspec_reader(path: str):
    """DCP's storage reader for a remote (fsspec) path."""
    return find(_FSSPEC_READER)(path)


def dcp_metadata_private_globals() -> dict:
    """`{(module, name): object}` of the private names DCP's `.metadata` pickles."""
    return {
        (internal.module, internal.name): find(internal)
        for internal in (_DCP_STORAGE_INFO, _DCP_MEMORY_FORMAT, _TORCH_GET_LAYOUT)
    }


_MODULE_PARAMETERS = Internal(
    "torch",
    "torch.nn.Module()",
    "_parameters",
    "the parameters a module registers under their names: where FSDP2 swaps a shard for "
    "the gathered weight and back, which a sharded Keras variable reads (fsdp)",
)
_COMPOSABLE_STATES = Internal(
    "torch",
    "torch.distributed._composable_state",
    "_module_state_mapping",
    "the FSDP2 state of each module that fully_shard was applied to, taken off again when "
    "a call ends (fsdp leaves the user's model plain between calls)",
)
_COMPOSABLE_STATE_KEY = Internal(
    "torch",
    "torch.distributed._composable.contract",
    "STATE_KEY",
    "where fully_shard records itself on a module (taken off as above)",
)
_COMPOSABLE_REGISTRY_KEY = Internal(
    "torch",
    "torch.distributed._composable.contract",
    "REGISTRY_KEY",
    "where fully_shard registers itself on a module (taken off as above)",
)
_FSDP_HOOKS = Internal(
    "torch",
    "torch.distributed.fsdp (FSDPState)",
    "_pre_forward_hook_handle",
    "the forward hooks fully_shard puts on a module (removed as above)",
)
INTERNALS += [
    _MODULE_PARAMETERS,
    _COMPOSABLE_STATES,
    _COMPOSABLE_STATE_KEY,
    _COMPOSABLE_REGISTRY_KEY,
]


def module_parameters(module) -> dict:
    """The parameters `module` registers, by name (`nn.Module._parameters`), to read and
    replace in place."""
    try:
        return module._parameters
    except AttributeError:
        raise missing(_MODULE_PARAMETERS) from None


def fsdp_remove(module, original_class: type) -> None:
    """Take FSDP2's `fully_shard` off `module` again: its forward hooks, its state, its
    record on the module, and the class it gave the module (`original_class` back). The
    parameters are the caller's to put back (`module_parameters`)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)
    for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        handle = getattr(state, name, None)
        if handle is None:
            raise missing(_FSDP_HOOKS)
        handle.remove()
    find(_COMPOSABLE_STATES).pop(module, None)
    module.__dict__.pop(find(_COMPOSABLE_STATE_KEY), None)
    module.__dict__.pop(find(_COMPOSABLE_REGISTRY_KEY), None)
    module.__class__ = original_class
