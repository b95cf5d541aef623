"""Every file keras_accel writes itself (History logs, `.keras` files, locks, Keras-layout
backups), on local paths and URLs alike, through fsspec.

fsspec is the one file-system library here, chosen because it decides by the URL alone:
`gs://` is always gcsfs, `s3://` always s3fs, `memory://` always fsspec's in-memory store,
whether or not TensorFlow happens to be imported (etils.epath, the alternative, switches to
`tf.io.gfile` when TensorFlow is installed). A protocol whose package is missing is an error
that names the package. Checkpoint arrays do not go through here: their engines (Orbax,
tf.train; see `keras_accel.state.engines`) write them.

Writes that must survive a crash use `write_atomic` / `upload`: on a local disk the data goes
to a hidden sibling, is fsynced and renamed over the target (one step); object stores write an
object whole in one request. Either way the target is always the old file or the new one.

Example:

>>> from keras_accel.state import files
>>> files.write_atomic("memory://docs/run/state.json", b'{"epoch": 3}')
>>> files.read_bytes("memory://docs/run/state.json")
b'{"epoch": 3}'
>>> files.listdir("memory://docs/run")
['state.json']
>>> files.rmtree("memory://docs")
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import fsspec

# Packages fsspec needs for the common protocols, for the error a missing one raises.
PROTOCOL_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "az": "adlfs", "abfs": "adlfs"}


def scheme(path: str) -> str:
    """The URL scheme of `path` ("gs", "memory", ...), or "" for a local path."""
    head, sep, _ = os.fspath(path).partition("://")
    if sep and head and all(c.isalnum() or c in "+-." for c in head):
        return head.lower()
    return ""


def is_remote(path: str) -> bool:
    """True for URLs other than `file://`."""
    return scheme(path) not in ("", "file")


def local_path(path: str) -> str:
    path = os.fspath(path)
    return path[len("file://") :] if path.startswith("file://") else path


def _fs(path: str):
    """`(filesystem, path within it)`; a clear error for a protocol nothing serves.

    Object stores' file systems (s3fs, gcsfs) cache the listings they read, for the life of
    the process; what another process wrote since (a peer's checkpoint, a removed one) would
    be missed, so every call here reads the store afresh."""
    path = os.fspath(path)
    if not is_remote(path):
        return None, local_path(path)
    try:
        fs, inner = fsspec.core.url_to_fs(path)
        fs.invalidate_cache()
        return fs, inner
    except (ImportError, ValueError) as error:
        kind = scheme(path)
        package = PROTOCOL_PACKAGES.get(kind)
        hint = f"`pip install {package}`" if package else f"the fsspec package for {kind}://"
        raise ValueError(
            f"No file system can open {path!r}: {kind}:// needs {hint} ({error}). Local "
            "paths and memory:// always work."
        ) from error


def join(base: str, *parts: str) -> str:
    if not is_remote(base):
        return os.path.join(base, *parts)
    path = os.fspath(base)
    for part in parts:
        part = part.strip("/")
        # A bare "memory://" ends in its separator already; stripping it would lose a "/".
        path = f"{path}{part}" if path.endswith("/") else f"{path}/{part}"
    return path


def split(path: str) -> tuple[str, str]:
    path = os.fspath(path)
    if is_remote(path):
        head, sep, rest = path.partition("://")
        parent, name = posixpath.split(rest.rstrip("/"))
        return (f"{head}{sep}{parent}" if parent else f"{head}{sep}", name)
    return os.path.split(path)


def dirname(path: str) -> str:
    return split(path)[0]


def basename(path: str) -> str:
    return split(path)[1]


def exists(path: str) -> bool:
    fs, inner = _fs(path)
    return os.path.exists(inner) if fs is None else fs.exists(inner)


def isdir(path: str) -> bool:
    fs, inner = _fs(path)
    return os.path.isdir(inner) if fs is None else fs.isdir(inner)


def isfile(path: str) -> bool:
    fs, inner = _fs(path)
    return os.path.isfile(inner) if fs is None else fs.isfile(inner)


def makedirs(path: str) -> None:
    """Create `path` and its parents; an existing directory is fine, an existing file is not.

    Raises:
        FileExistsError: `path` (or, on an object store, a parent) is a file.
    """
    fs, inner = _fs(path)
    if fs is None:
        os.makedirs(inner, exist_ok=True)
        return
    # Object stores "create" a directory over (or under) a file without complaint.
    child = inner
    while child and child not in ("/", "."):
        if fs.isfile(child):
            raise FileExistsError(f"Cannot create directory {path!r}: {child!r} is a file.")
        parent = posixpath.dirname(child.rstrip("/"))
        if parent == child:
            break
        child = parent
    fs.makedirs(inner, exist_ok=True)


def listdir(path: str) -> list[str]:
    """Sorted names (not paths) of the entries of directory `path`."""
    fs, inner = _fs(path)
    if fs is None:
        return sorted(os.listdir(inner))
    if not fs.isdir(inner):
        raise FileNotFoundError(f"No such directory: {path!r}")
    return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(inner, detail=False))


def read_bytes(path: str) -> bytes:
    fs, inner = _fs(path)
    if fs is None:
        with open(inner, "rb") as f:
            return f.read()
    return fs.cat_file(inner)


def read_text(path: str, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


def write_atomic(path: str, data: bytes | str) -> None:
    """Replace `path` by `data` so that a crash leaves the old or the new file, never a part."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    fs, inner = _fs(path)
    if fs is not None:
        fs.pipe_file(inner, data)  # One request: the object appears whole or not at all.
        return

    def fill(temp: str) -> None:
        with open(temp, "wb") as f:
            f.write(data)

    replace_local(inner, fill)


def numbered(directory: str, number, marker_of) -> dict[int, bool]:
    """`{N: committed}` for every entry of `directory` whose name `number` (a compiled
    pattern with the step as its group 1) matches, committed where `marker_of(N)` exists;
    `{}` where the directory does not exist. The listing checkpoint engines share."""
    try:
        names = listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {}
    for name in names:
        match = number.match(name)
        if match:
            step = int(match.group(1))
            found[step] = exists(marker_of(step))
    return found


def create_new(path: str, data: bytes | str) -> bool:
    """Create `path` holding `data` only if nothing is there, in one step, so that of two
    writers at the same moment one wins: True if this one did. An object store's
    conditional PUT (fsspec's "create" mode: `If-None-Match: *` on s3, `ifGenerationMatch=0`
    on gs); on a local disk the data is written to a hidden sibling, then hard-linked to
    `path` (`link` fails if the name exists), so the file appears whole or not at all."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    fs, inner = _fs(path)
    if fs is not None:
        try:
            fs.pipe_file(inner, data, mode="create")
        except FileExistsError:
            return False
        return True
    temp = temp_sibling(inner)
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(temp, inner)
        except FileExistsError:
            return False
        except OSError:
            # No hard links on this file system (some network and FUSE mounts): an
            # exclusive create, whose data a racing reader may briefly see empty.
            try:
                fd = os.open(inner, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.remove(temp)


def upload(local_file: str, path: str) -> None:
    """Copy the local file `local_file` to `path` (any storage), atomically as above."""
    fs, inner = _fs(path)
    if fs is not None:
        fs.put_file(local_file, inner)
        return
    replace_local(inner, lambda temp: shutil.copyfile(local_file, temp))


def replace_local(path: str, fill) -> None:
    """Replace the local file `path` by what `fill(temp)` writes into a hidden sibling: the
    sibling is synced to disk, renamed over `path` in one step, and the rename synced in
    its directory, so that a crash leaves the old file or the new one, never a part. The
    sibling is removed if anything fails."""
    temp = _temp_sibling(path)
    try:
        fill(temp)
        with open(temp, "rb") as f:
            os.fsync(f.fileno())  # The data is on disk before the name points at it...
        os.replace(temp, path)
        _fsync_dir(os.path.dirname(path))  # ...and the rename itself survives a power cut.
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise


def remove(path: str) -> None:
    fs, inner = _fs(path)
    if fs is None:
        os.remove(inner)
    else:
        fs.rm_file(inner)


def rmtree(path: str) -> None:
    fs, inner = _fs(path)
    if fs is None:
        shutil.rmtree(inner)
    else:
        fs.rm(inner, recursive=True)


def move(source: str, target: str) -> None:
    """Move the file or directory `source` to `target` (its parent made where missing). A
    rename on a local disk; on an object store a copy of every object, then their removal
    (the store has no rename)."""
    fs, inner = _fs(source)
    if fs is None:
        _, inner_target = _fs(target)
        os.makedirs(os.path.dirname(inner_target) or ".", exist_ok=True)
        os.replace(inner, inner_target)
        return
    copy(source, target)
    fs.rm(inner, recursive=fs.isdir(inner))


def copy(source: str, target: str) -> None:
    """Copy the file or directory `source` to `target` on the same storage (its parent
    made where missing)."""
    fs, inner = _fs(source)
    _, inner_target = _fs(target)
    if fs is None:
        os.makedirs(os.path.dirname(inner_target) or ".", exist_ok=True)
        if os.path.isdir(inner):
            shutil.copytree(inner, inner_target)
        else:
            shutil.copy2(inner, inner_target)
        return
    # A copy, never `mv`: gcsfs's asks GCS's moveTo first, which flat buckets answer with
    # 501 after retrying for 32 s (tests/gcs_emulator.py), then copies anyway.
    fs.copy(inner, inner_target, recursive=fs.isdir(inner))


def info(path: str) -> dict:
    """What the storage says of the file `path`, read afresh: fsspec's `info` (`size`, and
    what the store adds: GCS's `crc32c`, S3's `ETag`, ...); locally `{"size": ...}`."""
    fs, inner = _fs(path)
    if fs is None:
        return {"size": os.path.getsize(inner)}
    return fs.info(inner)


def getmtime(path: str) -> float | None:
    """Modification time in seconds since the epoch, or None where the storage has none."""
    fs, inner = _fs(path)
    if fs is None:
        return os.path.getmtime(inner)
    try:
        modified = fs.modified(inner)
    except (NotImplementedError, OSError, ValueError):
        return None
    return modified.timestamp() if modified is not None else None


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local file with the contents of `path`, for libraries that read local files only.

    A local `path` is yielded as it is; a URL is downloaded to a temporary file that keeps
    its name (Keras checks endings such as `.weights.h5`) and is deleted afterwards.

    Example:

    ```python
    with keras_accel.state.files.local_copy("gs://bucket/run/model.keras") as local:
        model = keras.saving.load_model(local)
    ```
    """
    fs, inner = _fs(path)
    if fs is None:
        yield inner
        return
    directory = tempfile.mkdtemp(prefix="keras_accel-")
    try:
        local = os.path.join(directory, basename(path))
        fs.get_file(inner, local)
        yield local
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def temp_sibling(path: str) -> str:
    """A hidden, unique local name beside `path` that ends like `path` (for writers that need
    a local file: Keras refuses a `save_weights` target not ending in `.weights.h5`)."""
    return _temp_sibling(local_path(path))


def _temp_sibling(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:  # Some platforms cannot open directories: nothing to sync.
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
