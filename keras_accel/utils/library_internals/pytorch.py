"""torch's: a tensor's in-place version counter, and torch.distributed.checkpoint's (DCP's)
one-process saver and its fsspec storage writer and reader."""

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
INTERNALS = [_TENSOR_VERSION, _SAVE_STATE_DICT, _FSSPEC_WRITER, _FSSPEC_READER]


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
