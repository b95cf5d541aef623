"""TensorFlow's gfile: gs:// (and ram://, hdfs://) where TensorFlow is already in use."""

from __future__ import annotations

import functools
from typing import IO

import tensorflow as tf

from keras_accel.io._base import FileSystem, join

gfile = tf.io.gfile


def _as_os_errors(method):
    """gfile raises `tf.errors`; callers of keras_accel.io catch `OSError` on every storage."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except tf.errors.NotFoundError as e:
            raise FileNotFoundError(e.message) from e
        except tf.errors.PermissionDeniedError as e:
            raise PermissionError(e.message) from e
        except tf.errors.AlreadyExistsError as e:
            raise FileExistsError(e.message) from e
        except tf.errors.OpError as e:
            raise OSError(e.message) from e

    return wrapper


def registered_schemes() -> set[str]:
    try:
        return set(gfile.get_registered_schemes())
    except AttributeError:  # Older TensorFlow: the schemes every build has.
        return {"gs", "ram", "file", ""}


class GFileSystem(FileSystem):
    name = "gfile"

    @_as_os_errors
    def exists(self, path: str) -> bool:
        return gfile.exists(path)

    @_as_os_errors
    def isdir(self, path: str) -> bool:
        return gfile.isdir(path)

    @_as_os_errors
    def makedirs(self, path: str) -> None:
        gfile.makedirs(path)

    @_as_os_errors
    def listdir(self, path: str) -> list[str]:
        # gfile marks directories of object stores with a trailing "/".
        return sorted({name.rstrip("/") for name in gfile.listdir(path)})

    def open(self, path: str, mode: str = "rb") -> IO:
        # GFile opens lazily: its errors surface on read, write or close.
        return _File(gfile.GFile(path, mode))

    @_as_os_errors
    def remove(self, path: str) -> None:
        gfile.remove(path)

    @_as_os_errors
    def rmtree(self, path: str) -> None:
        gfile.rmtree(path)

    @_as_os_errors
    def rename(self, source: str, target: str) -> None:
        if not gfile.isdir(source):
            gfile.rename(source, target, overwrite=True)
            return
        # Object stores cannot rename a directory: copy it file by file, then delete it.
        gfile.makedirs(target)
        for name in gfile.listdir(source):
            name = name.rstrip("/")
            self.rename(join(source, name), join(target, name))
        gfile.rmtree(source)

    def getmtime(self, path: str) -> float | None:
        try:
            return gfile.stat(path).mtime_nsec / 1e9
        except (tf.errors.OpError, AttributeError):
            return None

    @_as_os_errors
    def put(self, local_path: str, path: str) -> None:
        gfile.copy(local_path, path, overwrite=True)

    @_as_os_errors
    def get(self, path: str, local_path: str) -> None:
        gfile.copy(path, local_path, overwrite=True)


class _File:
    """A GFile whose errors are `OSError`s."""

    def __init__(self, file):
        self._file = file

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    @_as_os_errors
    def read(self, n: int = -1) -> bytes:
        return self._file.read(n)

    @_as_os_errors
    def write(self, data) -> int:
        return self._file.write(data)

    @_as_os_errors
    def close(self) -> None:
        self._file.close()
