"""Local disk through `os`: the only storage with fsync and one-step renames."""

from __future__ import annotations

import os
import shutil
from typing import IO

from keras_accel.io._base import FileSystem


def _local(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


class LocalFileSystem(FileSystem):
    name = "local"
    atomic_rename = True

    def exists(self, path: str) -> bool:
        return os.path.exists(_local(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(_local(path))

    def isfile(self, path: str) -> bool:
        return os.path.isfile(_local(path))

    def makedirs(self, path: str) -> None:
        os.makedirs(_local(path), exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(_local(path)))

    def open(self, path: str, mode: str = "rb") -> IO:
        return open(_local(path), mode)

    def remove(self, path: str) -> None:
        os.remove(_local(path))

    def rmtree(self, path: str) -> None:
        shutil.rmtree(_local(path))

    def rename(self, source: str, target: str) -> None:
        os.replace(_local(source), _local(target))

    def getmtime(self, path: str) -> float | None:
        return os.path.getmtime(_local(path))

    def put(self, local_path: str, path: str) -> None:
        shutil.copyfile(local_path, _local(path))

    def get(self, path: str, local_path: str) -> None:
        shutil.copyfile(_local(path), local_path)

    def fsync_file(self, path: str) -> None:
        with open(_local(path), "rb") as f:
            os.fsync(f.fileno())

    def fsync_dir(self, path: str) -> None:
        path = _local(path) or "."
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # Some platforms (Windows) cannot open directories; nothing to sync.
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
