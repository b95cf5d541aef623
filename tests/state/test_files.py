"""keras_accel.state.files against real storage: the local disk and fsspec's memory://."""

import os
import subprocess
import sys
import textwrap
import time
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from keras_accel.state import files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _memory_root():
    return f"memory://test-files-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    """A fresh, not yet created directory on each kind of storage."""
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    path = _memory_root()
    yield path
    if files.exists(path):
        files.rmtree(path)


def test_schemes():
    assert files.scheme("GS://bucket/x") == "gs" and files.scheme("memory://a") == "memory"
    assert files.scheme("/tmp/x") == "" and files.scheme(r"C:\x") == ""
    assert files.is_remote("s3://b/x") and files.is_remote("memory://x")
    assert not files.is_remote("file:///tmp/x") and not files.is_remote("relative/dir")
    assert files.local_path("file:///tmp/x") == "/tmp/x"


def test_paths_split_and_join():
    assert files.split("gs://bucket/run/x.json") == ("gs://bucket/run", "x.json")
    assert files.split("memory://a") == ("memory://", "a")
    assert files.dirname("gs://bucket/run/") == "gs://bucket"
    assert files.basename("gs://bucket/run/x.json") == "x.json"
    assert files.dirname("/a/b") == "/a" and files.dirname("/a") == "/"
    assert files.dirname("a") == ""
    assert files.join("memory://", "a", "b") == "memory://a/b"
    assert files.join("gs://bucket/run/", "/x") == "gs://bucket/run/x"
    assert files.join("/tmp/", "x") == "/tmp/x"


def test_files_and_directories(root):
    sub = files.join(root, "sub", "deeper")
    files.makedirs(sub)
    files.makedirs(sub)  # Existing directory: fine.
    assert files.isdir(sub) and files.exists(sub) and not files.isfile(sub)
    target = files.join(sub, "a.txt")
    files.write_atomic(target, b"one")
    assert files.isfile(target) and files.read_bytes(target) == b"one"
    files.write_atomic(target, "two")  # Text is written as UTF-8.
    assert files.read_text(target) == "two"
    assert files.listdir(sub) == ["a.txt"]  # No temporary sibling left behind.
    assert abs(files.getmtime(target) - time.time()) < 60
    files.remove(target)
    assert files.listdir(sub) == [] and not files.exists(target)
    files.rmtree(files.join(root, "sub"))
    assert not files.exists(files.join(root, "sub"))


def test_makedirs_over_a_file_is_refused(root):
    files.makedirs(root)
    files.write_atomic(files.join(root, "file"), b"x")
    with pytest.raises(FileExistsError):
        files.makedirs(files.join(root, "file"))
    # The local disk says NotADirectoryError under a file; object stores would not say
    # anything, so files checks the parents itself.
    with pytest.raises((FileExistsError, NotADirectoryError)):
        files.makedirs(files.join(root, "file", "sub"))
    assert files.read_bytes(files.join(root, "file")) == b"x"


def test_missing_paths_raise_file_not_found(root):
    files.makedirs(root)
    with pytest.raises(FileNotFoundError):
        files.read_bytes(files.join(root, "nope"))
    with pytest.raises(FileNotFoundError):
        files.listdir(files.join(root, "nope"))
    with pytest.raises(FileNotFoundError):
        files.remove(files.join(root, "nope"))


def test_upload_and_local_copy(root, tmp_path):
    files.makedirs(root)
    local = tmp_path / "model.weights.h5"
    local.write_bytes(b"weights")
    target = files.join(root, "model.weights.h5")
    files.upload(str(local), target)
    assert files.read_bytes(target) == b"weights"
    assert sorted(files.listdir(root)) == ["model.weights.h5"]
    with files.local_copy(target) as copy:
        # The copy keeps the name: Keras checks endings such as .weights.h5.
        assert os.path.basename(copy) == "model.weights.h5"
        with open(copy, "rb") as f:
            assert f.read() == b"weights"
    if files.is_remote(target):
        assert not os.path.exists(copy)  # The temporary download is gone.
    else:
        assert copy == target and os.path.exists(copy)  # A local file is used in place.


def test_temp_sibling_is_hidden_unique_and_keeps_the_ending(tmp_path):
    target = str(tmp_path / "m.weights.h5")
    first, second = files.temp_sibling(target), files.temp_sibling(f"file://{target}")
    assert first != second
    for temp in (first, second):
        assert os.path.dirname(temp) == str(tmp_path)
        assert os.path.basename(temp).startswith(".") and temp.endswith(".weights.h5")


def _crash(exception):
    def crash(*args, **kwargs):
        raise exception

    return crash


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_crash_during_a_local_write_keeps_the_old_file(tmp_path, monkeypatch, step):
    target = str(tmp_path / "state.json")
    files.write_atomic(target, b"old")
    # Killed after the new data is written (before it is durable, or before the rename).
    monkeypatch.setattr(os, step, _crash(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(target, b"new")
    with pytest.raises(KeyboardInterrupt):
        files.upload(__file__, target)
    monkeypatch.undo()
    assert files.read_bytes(target) == b"old"
    assert os.listdir(tmp_path) == ["state.json"]  # Temporary siblings cleaned up.


def test_a_failed_remote_write_keeps_the_old_object(monkeypatch):
    root = _memory_root()
    target = files.join(root, "state.json")
    files.write_atomic(target, b"old")
    # An object store takes the object in one request: a failed request changes nothing.
    monkeypatch.setattr(MemoryFileSystem, "pipe_file", _crash(OSError("connection reset")))
    monkeypatch.setattr(MemoryFileSystem, "put_file", _crash(OSError("connection reset")))
    with pytest.raises(OSError, match="connection reset"):
        files.write_atomic(target, b"new")
    with pytest.raises(OSError, match="connection reset"):
        files.upload(__file__, target)
    monkeypatch.undo()
    assert files.read_bytes(target) == b"old" and files.listdir(root) == ["state.json"]
    files.rmtree(root)


def test_a_killed_process_leaves_the_old_file_whole(tmp_path):
    """A real death: no exception handler runs, so only the rename protects the target."""
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    code = textwrap.dedent(
        f"""
        import os
        from keras_accel.state import files
        os.replace = lambda *args: os._exit(9)  # Dies between the write and the rename.
        files.write_atomic({str(target)!r}, b"new" * 1000)
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert result.returncode == 9, result.stderr[-2000:]
    assert target.read_bytes() == b"old"
    leftovers = [p for p in tmp_path.iterdir() if p.name != "state.json"]
    # The half-finished write is only ever a hidden sibling, never the target.
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".")


def test_unavailable_protocols_name_their_package(monkeypatch):
    if "gs" in fsspec.registry:
        pytest.skip("gcsfs is already imported in this process")
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # As if gcsfs were not installed.
    with pytest.raises(ValueError, match=r"gs://bucket/x.*pip install gcsfs"):
        files.exists("gs://bucket/x")
    with pytest.raises(ValueError, match=r"nosuchfs://.*fsspec"):
        files.read_bytes("nosuchfs://bucket/x")


def test_the_protocol_alone_decides_the_file_system(backend):
    """gs:// is gcsfs and memory:// fsspec's memory store, with TensorFlow imported or not
    (the old layer switched to tf.io.gfile once TensorFlow was in the process)."""
    if backend == "tensorflow":
        assert "tensorflow" in sys.modules
    else:
        pytest.importorskip("tensorflow")  # A tf.data pipeline in a JAX run imports it too.
    root = _memory_root()
    files.write_atomic(f"{root}/x.bin", b"data")
    store = fsspec.filesystem("memory")
    assert store.cat_file(f"{root}/x.bin") == b"data"
    # ram:// is TensorFlow's own in-memory file system, which fsspec does not serve.
    with pytest.raises(ValueError, match="ram://"):
        files.exists("ram://x")
    files.rmtree(root)
