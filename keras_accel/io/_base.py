"""The contract every file system of `keras_accel.io` fulfils, and the operations built on it."""

from __future__ import annotations

import contextlib
import uuid
from typing import IO


class FileSystem:
    """One kind of storage: local disk, TensorFlow's gfile, or an fsspec file system.

    Paths are full paths or URLs (`/tmp/a`, `gs://bucket/a`, `memory://a`). Subclasses
    implement the primitives; the composite operations (atomic writes, uploads) are built
    here from them, so every storage gets the same guarantees.
    """

    name = "abstract"
    # True where `rename` replaces the target in one step that a crash cannot split (POSIX
    # rename). Object stores copy, then delete: still whole objects, but not one step.
    atomic_rename = False

    # Primitives.
    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def isfile(self, path: str) -> bool:
        return self.exists(path) and not self.isdir(path)

    def makedirs(self, path: str) -> None:
        raise NotImplementedError

    def listdir(self, path: str) -> list[str]:
        raise NotImplementedError

    def open(self, path: str, mode: str = "rb") -> IO:
        raise NotImplementedError

    def remove(self, path: str) -> None:
        raise NotImplementedError

    def rmtree(self, path: str) -> None:
        raise NotImplementedError

    def rename(self, source: str, target: str) -> None:
        """Move a file or a directory, replacing a target file."""
        raise NotImplementedError

    def getmtime(self, path: str) -> float | None:
        return None

    def put(self, local_path: str, path: str) -> None:
        """Copy a local file to `path` (not atomic: see `upload`)."""
        with open(local_path, "rb") as source, self.open(path, "wb") as target:
            _copy_stream(source, target)

    def get(self, path: str, local_path: str) -> None:
        """Copy `path` to a local file."""
        with self.open(path, "rb") as source, open(local_path, "wb") as target:
            _copy_stream(source, target)

    def fsync_file(self, path: str) -> None:
        """Make a written file durable; only local disks need (and allow) it."""

    def fsync_dir(self, path: str) -> None:
        """Make renames inside a directory durable; only local disks need (and allow) it."""

    # Composites.
    def temp_sibling(self, path: str) -> str:
        """A fresh name next to `path`, hidden, ending like `path` (Keras checks endings)."""
        parent, base = split(path)
        return join(parent, f".tmp-{uuid.uuid4().hex[:12]}-{base}")

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write `data` to a temporary sibling, make it durable, then rename it over `path`.

        A reader (or a crash) sees either the old file or the new one, never a part of one.
        """
        temp = self.temp_sibling(path)
        try:
            with self.open(temp, "wb") as f:
                f.write(data)
            self.fsync_file(temp)
            self.rename(temp, path)
            self.fsync_dir(split(path)[0])
        except BaseException:
            _quietly(self.remove, temp)
            raise

    def upload(self, local_path: str, path: str) -> None:
        """Copy a local file to `path` through a temporary sibling, so `path` is whole or old."""
        temp = self.temp_sibling(path)
        try:
            self.put(local_path, temp)
            self.fsync_file(temp)
            self.rename(temp, path)
            self.fsync_dir(split(path)[0])
        except BaseException:
            _quietly(self.remove, temp)
            raise


def split(path: str) -> tuple[str, str]:
    """`(parent, name)` of a path or URL; `parent` keeps the scheme."""
    stripped = path.rstrip("/")
    scheme, sep, rest = stripped.partition("://")
    if not sep:
        scheme, rest = "", stripped
    head, slash, tail = rest.rpartition("/")
    if not slash:
        return (f"{scheme}://" if sep else ""), tail
    if not head:  # "/name" or "scheme:///name".
        head = "/"
    return (f"{scheme}://{head}" if sep else head), tail


def join(base: str, *parts: str) -> str:
    """Join path components with "/", the separator of URLs and POSIX paths alike."""
    path = base
    for part in parts:
        path = f"{path}{part}" if not path or path.endswith("/") else f"{path}/{part}"
    return path


def _copy_stream(source, target, chunk: int = 1 << 22) -> None:
    while True:
        block = source.read(chunk)
        if not block:
            break
        target.write(block)


def _quietly(function, *args) -> None:
    # Clean-up after an error must not replace that error with its own.
    with contextlib.suppress(Exception):
        function(*args)
