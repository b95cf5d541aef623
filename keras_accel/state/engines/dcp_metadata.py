"""Reading torch.distributed.checkpoint's `.metadata` without running any code from it.

DCP's `FileSystemReader.read_metadata` reads a step's `.metadata` (its index: which key lies
in which file, at which offset, with which shape and dtype) with a plain `pickle.load`, and
torch offers no weights-only path or allow-list hook for it (torch 2.13). A pickle can call
any function it names (`os.system`, `builtins.eval`, `subprocess.Popen`...), so anyone who
can write a backup folder (a shared bucket, NFS) could run code in every job that resumes
from it. `.metadata` is also the one file of a step its checksum record cannot cover: DCP
writes it after the record, as its commit.

So a step's `.metadata` is read here, through `MetadataUnpickler`: only the globals an index
is made of are allowed (DCP's metadata dataclasses, torch sizes, dtypes and layouts, paths,
plain containers); any other is refused before it is looked up, with `Refused`, a
`checksums.Damaged`, naming the file and the global: the step is set aside as damaged and
the newest intact one restored (`keras_accel.state.recovery`). What it rebuilds is then
checked to be an index of tensors whose files lie in the step:

- a `BytesStorageMetadata` entry is refused: DCP reads such a value back with
  `torch.load(weights_only=False)` (its default planner's `load_bytes`), a second way to
  run code, and keras_accel saves tensors only;
- a file name with a directory part (`../../etc/...`) is refused: DCP would read it.

The restore then hands DCP this checked index instead of letting it unpickle the file
(`reader(path)`); the tensors themselves DCP reads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import builtins
import collections
import io
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from keras_accel.state import checksums, files
from keras_accel.utils import library_internals

COMMIT = ".metadata"


class Refused(checksums.Damaged):
    """A step's `.metadata` names a global no DCP index is made of (or is no index of
    tensors): refused unread, nothing of it run. A `checksums.Damaged`, so that the step is
    set aside as a damaged one is."""


def _allowed() -> dict:
    """`{(module, name): object}`: every global a DCP index of tensors pickles."""
    allowed = {
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
        )
    }
    allowed.update(library_internals.dcp_metadata_private_globals())
    allowed[("torch", "Size")] = torch.Size
    # The checkpoint's path, as DCP records it (`StorageMeta.checkpoint_id`); Python 3.13
    # pickles pathlib's classes under pathlib._local.
    for module in ("pathlib", "pathlib._local"):
        for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            allowed[(module, name)] = getattr(pathlib, name)
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("builtins", "set")] = builtins.set
    allowed[("builtins", "frozenset")] = builtins.frozenset
    return allowed


_ALLOWED: dict = {}


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds DCP's index and nothing else.

    Every global a pickle names is looked up here (`find_class`, also for the copyreg
    extension codes); the allowed ones are data classes and constructors of plain values,
    none of which reaches the file system, a process or the interpreter. Anything else
    raises `Refused` naming the global.

    Args:
        file: the open `.metadata`.
        name: the file's name in messages.
    """

    def __init__(self, file, name: str = COMMIT):
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str):
        if not _ALLOWED:
            _ALLOWED.update(_allowed())
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"):
            raise Refused(
                self.name,
                "holds a value saved as bytes (BytesStorageMetadata), which DCP reads back "
                "with torch.load(weights_only=False), a pickle that can run code; "
                "keras_accel saves tensors only, so it never wrote this index: refused "
                "unread, nothing of it ran",
            )
        raise Refused(
            self.name,
            f"its pickle loads the global {module}.{name}, which no DCP index is made of "
            "(DCP's metadata classes, torch sizes, dtypes and layouts, paths, plain "
            "containers): refused unread, nothing of it ran. DCP never writes it: the "
            "file was replaced",
        )

    def persistent_load(self, pid):
        raise Refused(self.name, "its pickle asks for a persistent id, which DCP never writes")


def loads(data: bytes, name: str = COMMIT) -> dcp_metadata.Metadata:
    """The checked index pickled in `data` (the bytes of a `.metadata`).

    Raises:
        Refused: a global outside the allow-list, or no index of tensors in the step.
        checksums.Damaged: the bytes are no pickle at all (cut short, overwritten).
    """
    try:
        found = MetadataUnpickler(io.BytesIO(data), name).load()
    except Refused:
        raise
    except Exception as error:  # A truncated or foreign file: damage, not an attack.
        raise checksums.Damaged(
            name, f"unreadable ({type(error).__name__}: {str(error)[:200]})"
        ) from error
    _check(found, name)
    return found


def read(step_path: str) -> dcp_metadata.Metadata:
    """The checked index of the DCP step at `step_path` (local or a URL); see `loads`."""
    try:
        data = files.read_bytes(files.join(step_path, COMMIT))
    except FileNotFoundError as error:
        raise checksums.Damaged(COMMIT, "missing") from error
    return loads(data)


def _check(found, name: str) -> None:
    """An index of tensors whose every file is a plain name in the step."""
    if not isinstance(found, dcp_metadata.Metadata):
        raise Refused(name, f"its pickle is a {type(found).__name__}, not DCP's Metadata")
    entries = found.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(entry, dcp_metadata.TensorStorageMetadata) for entry in entries.values()
    ):
        raise Refused(name, "its index lists something other than tensors")
    storage = found.storage_data
    if not isinstance(storage, dict):
        raise Refused(name, f"its storage data is a {type(storage).__name__}, not a dict")
    for info in storage.values():
        where = getattr(info, "relative_path", None)
        if (
            not isinstance(where, str)
            or not where
            or where.startswith(".")
            or "/" in where
            or "\\" in where
        ):
            raise Refused(
                name, f"its index points at {where!r}, not at a file of the step: refused"
            )


def reader(step_path: str, storage_reader):
    """`storage_reader` (DCP's, for the step at `step_path`) that hands DCP the checked
    index instead of unpickling `.metadata` itself.

    Raises:
        Refused, checksums.Damaged: as `read`, before DCP reads anything.
    """
    index = read(step_path)
    if getattr(index, "storage_meta", None) is None:  # As DCP's read_metadata does.
        index.storage_meta = dcp_metadata.StorageMeta()
    index.storage_meta.load_id = storage_reader.load_id

    def read_metadata(*args, **kwargs):
        return index

    # On the object, as `_writer` wraps `finish`: `read_metadata` is the public
    # StorageReader hook, and the reader's class is DCP's (or fsspec's).
    storage_reader.read_metadata = read_metadata
    return storage_reader
