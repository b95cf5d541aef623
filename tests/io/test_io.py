"""keras_accel.io against real storage: the local disk, fsspec's memory://, and (on the
TensorFlow run) gfile's ram://."""

import os
import sys
import uuid

import pytest

from keras_accel import io
from keras_accel.io._base import FileSystem


def _memory_root():
    return f"memory://test-io-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["local", "memory", "gfile"])
def root(request, tmp_path, backend):
    """A fresh, empty directory on each kind of storage."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    if request.param == "memory":
        path = _memory_root()
        yield path
        if io.exists(path):
            io.rmtree(path)
        return
    if backend != "tensorflow":
        pytest.skip("gfile is used only where TensorFlow is already imported (the TF run)")
    path = f"ram://test-io-{uuid.uuid4().hex[:8]}"
    yield path
    if io.exists(path):
        io.rmtree(path)


def test_which_storage_serves_which_path(backend):
    assert io.filesystem("/tmp/x").name == "local"
    assert io.filesystem("file:///tmp/x").name == "local"
    assert io.filesystem("relative/dir").name == "local"
    assert io.filesystem("memory://a/b").name == "fsspec:memory"
    assert io.scheme("GS://bucket/x") == "gs" and io.is_remote("s3://b/x")
    assert not io.is_remote("file:///tmp/x") and not io.is_remote("/tmp/x")
    if "tensorflow" in sys.modules:
        assert io.filesystem("gs://bucket/x").name == "gfile"
        assert io.filesystem("ram://x").name == "gfile"


def test_url_without_a_file_system_is_a_clear_error():
    # Neither gfile nor fsspec knows this protocol.
    with pytest.raises(ValueError, match=r"nosuchfs://.*fsspec"):
        io.filesystem("nosuchfs://bucket/x")


def test_paths_split_and_join():
    assert io.dirname("gs://bucket/run/x.json") == "gs://bucket/run"
    assert io.basename("gs://bucket/run/x.json") == "x.json"
    assert io.dirname("/a/b") == "/a" and io.dirname("/a") == "/" and io.dirname("a") == ""
    assert io.join("memory://", "a", "b") == "memory://a/b"
    assert io.join("/tmp/", "x") == "/tmp/x"


def test_files_and_directories(root):
    sub = io.join(root, "sub", "deeper")
    io.makedirs(sub)
    io.makedirs(sub)  # Existing directory: fine.
    assert io.isdir(sub) and io.exists(sub) and not io.isfile(sub)
    target = io.join(sub, "a.txt")
    io.write_bytes(target, b"one")
    assert io.isfile(target) and io.read_bytes(target) == b"one"
    io.write_atomic(target, "two")
    assert io.read_text(target) == "two"
    assert io.listdir(sub) == ["a.txt"]  # No temporary file left behind.
    io.rename(target, io.join(sub, "b.txt"))
    assert io.listdir(sub) == ["b.txt"]
    io.remove(io.join(sub, "b.txt"))
    assert io.listdir(sub) == []
    io.rmtree(io.join(root, "sub"))
    assert not io.exists(io.join(root, "sub"))


def test_makedirs_over_a_file_is_refused(root):
    io.makedirs(root)
    io.write_bytes(io.join(root, "file"), b"x")
    with pytest.raises(FileExistsError, match="a file of that name exists"):
        io.makedirs(io.join(root, "file"))
    with pytest.raises((FileExistsError, NotADirectoryError)):
        io.makedirs(io.join(root, "file", "sub"))
    assert io.read_bytes(io.join(root, "file")) == b"x"


def test_directories_rename_whole(root):
    source = io.join(root, "src")
    io.makedirs(source)
    io.write_bytes(io.join(source, "f"), b"data")
    io.rename(source, io.join(root, "dst"))
    assert not io.exists(source)
    assert io.read_bytes(io.join(root, "dst", "f")) == b"data"


def test_upload_local_copy_and_copy_across_storages(root, tmp_path):
    io.makedirs(root)
    local = tmp_path / "model.weights.h5"
    local.write_bytes(b"weights")
    remote = io.join(root, "model.weights.h5")
    io.upload(str(local), remote)
    with io.local_copy(remote) as copy:
        # The copy keeps the name: Keras checks endings such as .weights.h5.
        assert copy.endswith("model.weights.h5")
        with open(copy, "rb") as f:
            assert f.read() == b"weights"
    if io.is_remote(remote):
        assert not os.path.exists(copy)  # The temporary download is gone.
    other = f"{_memory_root()}/copied.bin"
    io.copy(remote, other)
    assert io.read_bytes(other) == b"weights"
    io.rmtree(io.dirname(other))


def test_failed_atomic_write_keeps_the_old_file(root, monkeypatch):
    io.makedirs(root)
    target = io.join(root, "state.json")
    io.write_atomic(target, b"old")
    fs = io.filesystem(target)

    def broken_rename(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(fs, "rename", broken_rename)
    with pytest.raises(OSError, match="disk full"):
        io.write_atomic(target, b"new")
    with pytest.raises(OSError, match="disk full"):
        io.upload(__file__, target)
    monkeypatch.undo()
    assert io.read_bytes(target) == b"old"
    assert io.listdir(root) == ["state.json"]  # Temporary siblings cleaned up.


def test_missing_paths_raise_file_not_found(root):
    with pytest.raises(FileNotFoundError):
        io.read_bytes(io.join(root, "nope"))
    with pytest.raises(FileNotFoundError):
        io.listdir(io.join(root, "nope"))


def test_rename_across_storages_is_refused(tmp_path):
    with pytest.raises(ValueError, match="within one storage"):
        io.rename(str(tmp_path / "a"), "memory://x/a")


def test_the_contract_has_composites_built_on_primitives():
    # A storage only implements primitives; write_atomic/upload come from the base class.
    assert FileSystem.write_atomic is io.filesystem("memory://x").__class__.write_atomic
