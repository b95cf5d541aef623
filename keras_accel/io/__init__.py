"""One small file-system layer for checkpoints and logs: local paths and URLs alike.

Every writer in keras_accel goes through here, so a checkpoint directory can be a local
path, `gs://bucket/run` (the seed's TPU case: the TPU host cannot write local files), an
`s3://` URL or fsspec's `memory://`. Which storage serves a path:

- a local path (or `file://`): the operating system, with fsync and one-step renames;
- a URL whose scheme TensorFlow's gfile knows (`gs://`, `ram://`, ...), when TensorFlow
  is already imported (the backend, or a tf.data pipeline): gfile;
- any other URL: fsspec, when installed (`pip install fsspec`, plus `gcsfs` / `s3fs`).

TensorFlow is never imported here just to reach a file: a JAX run stays TensorFlow-free.

Writes that must survive a crash use `write_atomic` / `upload`: the data goes to a hidden
sibling first and is renamed over the target, so the target is always old or whole.

Example:

>>> from keras_accel import io
>>> io.write_atomic("memory://docs/run/state.json", b'{"epoch": 3}')
>>> io.read_bytes("memory://docs/run/state.json")
b'{"epoch": 3}'
>>> io.listdir("memory://docs/run"), io.filesystem("memory://docs").name
(['state.json'], 'fsspec:memory')
>>> io.rmtree("memory://docs")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import IO

from keras_accel.io._base import FileSystem, join, split
from keras_accel.io._local import LocalFileSystem

__all__ = [
    "FileSystem",
    "basename",
    "copy",
    "dirname",
    "exists",
    "filesystem",
    "getmtime",
    "isdir",
    "isfile",
    "is_remote",
    "join",
    "listdir",
    "local_copy",
    "makedirs",
    "open",
    "read_bytes",
    "read_text",
    "remove",
    "rename",
    "rmtree",
    "scheme",
    "upload",
    "write_atomic",
    "write_bytes",
]

_LOCAL = LocalFileSystem()
_CACHE: dict[tuple[str, str], FileSystem] = {}


def scheme(path: str) -> str:
    """The URL scheme of `path` ("gs", "memory", ...), or "" for a local path."""
    path = os.fspath(path)
    head, sep, _ = path.partition("://")
    # A Windows drive ("C:\\...") has no "://"; a scheme has letters, digits, + - . only.
    if sep and head and all(c.isalnum() or c in "+-." for c in head):
        return head.lower()
    return ""


def is_remote(path: str) -> bool:
    """True for URLs other than `file://`."""
    return scheme(path) not in ("", "file")


def filesystem(path: str) -> FileSystem:
    """The storage that serves `path` (see the module docstring for the order)."""
    path = os.fspath(path)
    kind = scheme(path)
    if kind in ("", "file"):
        return _LOCAL
    if "tensorflow" in sys.modules:
        from keras_accel.io import _gfile

        if kind in _gfile.registered_schemes():
            return _cached("gfile", kind, _gfile.GFileSystem)
    try:
        from keras_accel.io import _fsspec
    except ImportError:
        raise ValueError(
            f"No file system can open {path!r}: {kind}:// URLs need fsspec "
            f"(`pip install fsspec` plus its {kind} plugin, e.g. gcsfs or s3fs), or, for "
            "gs://, TensorFlow imported before the first file operation. Local paths always "
            "work."
        ) from None
    try:
        return _cached("fsspec", kind, lambda: _fsspec.FsspecFileSystem(kind))
    except (ImportError, ValueError) as e:
        raise ValueError(
            f"fsspec has no usable file system for {kind}:// (needed for {path!r}): {e}. "
            "Install the fsspec plugin for it (gcsfs for gs://, s3fs for s3://)."
        ) from e


def _cached(kind: str, protocol: str, factory) -> FileSystem:
    key = (kind, protocol)
    if key not in _CACHE:
        _CACHE[key] = factory()
    return _CACHE[key]


def dirname(path: str) -> str:
    """The parent of `path`, scheme kept (`gs://b/run/x` -> `gs://b/run`)."""
    return split(os.fspath(path))[0]


def basename(path: str) -> str:
    """The last component of `path`."""
    return split(os.fspath(path))[1]


def exists(path: str) -> bool:
    return filesystem(path).exists(os.fspath(path))


def isdir(path: str) -> bool:
    return filesystem(path).isdir(os.fspath(path))


def isfile(path: str) -> bool:
    return filesystem(path).isfile(os.fspath(path))


def makedirs(path: str) -> None:
    """Create `path` and its parents; an existing directory is fine, an existing file is not.

    Raises:
        FileExistsError: `path` (or a parent) is a file.
        PermissionError: the storage refuses to create it.
    """
    path = os.fspath(path)
    fs = filesystem(path)
    # Object stores "create" a directory over (or under) a file without complaint, where
    # the operating system refuses: check the path and, on remote storage, its parents.
    if fs.exists(path) and not fs.isdir(path):
        raise FileExistsError(f"Cannot create directory {path!r}: a file of that name exists.")
    if fs is not _LOCAL:
        child, parent = path, dirname(path)
        while parent and not parent.endswith("://") and parent != child:
            if fs.isfile(parent):
                raise FileExistsError(
                    f"Cannot create directory {path!r}: its parent {parent!r} is a file."
                )
            child, parent = parent, dirname(parent)
    fs.makedirs(path)


def listdir(path: str) -> list[str]:
    """Sorted names (not paths) of the entries of directory `path`."""
    return filesystem(path).listdir(os.fspath(path))


def open(path: str, mode: str = "rb") -> IO:  # noqa: A001 - mirrors the builtin on purpose.
    """A file object for `path`; modes "rb", "wb" (and text modes where the storage has them)."""
    return filesystem(path).open(os.fspath(path), mode)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def write_bytes(path: str, data: bytes) -> None:
    """Write `data` in place (not atomic; use `write_atomic` for anything a crash may hit)."""
    with open(path, "wb") as f:
        f.write(data)


def write_atomic(path: str, data: bytes | str) -> None:
    """Replace `path` by `data` so that a crash leaves the old or the new file, never a part.

    Local disks: temporary sibling, fsync, rename, fsync of the directory. Other storage:
    temporary sibling, then a rename (object stores write objects whole).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    filesystem(path).write_atomic(os.fspath(path), data)


def upload(local_path: str, path: str) -> None:
    """Copy the local file `local_path` to `path` (any storage) atomically, as `write_atomic`."""
    filesystem(path).upload(os.fspath(local_path), os.fspath(path))


def remove(path: str) -> None:
    filesystem(path).remove(os.fspath(path))


def rmtree(path: str) -> None:
    filesystem(path).rmtree(os.fspath(path))


def rename(source: str, target: str) -> None:
    """Move `source` to `target` on one storage, replacing a target file."""
    fs = filesystem(source)
    if filesystem(target) is not fs:
        raise ValueError(
            f"rename works within one storage. Received: source={source!r} "
            f"({fs.name}), target={target!r} ({filesystem(target).name}). Use copy()."
        )
    fs.rename(os.fspath(source), os.fspath(target))


def copy(source: str, target: str) -> None:
    """Copy one file, across storages if needed (target written atomically)."""
    with local_copy(source) as local:
        upload(local, target)


def getmtime(path: str) -> float | None:
    """Modification time in seconds since the epoch, or None where the storage has none."""
    return filesystem(path).getmtime(os.fspath(path))


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local file with the contents of `path`, for libraries that read local files only.

    A local `path` is yielded as it is; a URL is downloaded to a temporary file that keeps
    its name (Keras checks endings such as `.weights.h5`) and is deleted afterwards.

    Example:

    ```python
    with keras_accel.io.local_copy("gs://bucket/run/model.keras") as local:
        model = keras.saving.load_model(local)
    ```
    """
    path = os.fspath(path)
    fs = filesystem(path)
    if fs is _LOCAL:
        yield path[len("file://") :] if path.startswith("file://") else path
        return
    directory = tempfile.mkdtemp(prefix="keras_accel-")
    try:
        local = os.path.join(directory, basename(path))
        fs.get(path, local)
        yield local
    finally:
        shutil.rmtree(directory, ignore_errors=True)
