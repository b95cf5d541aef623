"""Any fsspec file system (memory://, s3:// with s3fs, gs:// with gcsfs, ...)."""

from __future__ import annotations

from typing import IO

import fsspec

from keras_accel.io._base import FileSystem


class FsspecFileSystem(FileSystem):
    """Wraps the fsspec file system that serves one protocol.

    fsspec methods take full URLs and strip the protocol themselves; `listdir` returns base
    names, like `os.listdir`.
    """

    def __init__(self, protocol: str):
        self.protocol = protocol
        self.fs = fsspec.filesystem(protocol)
        self.name = f"fsspec:{protocol}"

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def isfile(self, path: str) -> bool:
        return self.fs.isfile(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        if not self.fs.isdir(path):
            raise FileNotFoundError(f"No such directory: {path!r}")
        entries = self.fs.ls(path, detail=False)
        return sorted({entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries})

    def open(self, path: str, mode: str = "rb") -> IO:
        return self.fs.open(path, mode)

    def remove(self, path: str) -> None:
        self.fs.rm_file(path)

    def rmtree(self, path: str) -> None:
        self.fs.rm(path, recursive=True)

    def rename(self, source: str, target: str) -> None:
        if self.fs.isdir(source):
            self.fs.mv(source, target, recursive=True)
        else:
            if self.fs.exists(target):
                self.fs.rm_file(target)
            self.fs.mv(source, target)

    def getmtime(self, path: str) -> float | None:
        try:
            return self.fs.modified(path).timestamp()
        except (NotImplementedError, AttributeError, FileNotFoundError, OSError):
            return None

    def put(self, local_path: str, path: str) -> None:
        self.fs.put_file(local_path, path)

    def get(self, path: str, local_path: str) -> None:
        self.fs.get_file(path, local_path)
