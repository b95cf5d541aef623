"""Output files to local paths, memory://, and local S3 and GCS servers (moto's server,
gcp-storage-emulator; tests/object_stores.py):
written whole, local parents created, no bucket ever created, bad targets refused up front."""

import uuid

import pytest

from keras_accel.state import files, outputs

pytestmark = pytest.mark.torch  # Storage code, the same on every backend.


@pytest.fixture(params=["local", "memory", "s3", "gs"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path)
    elif request.param == "memory":
        url = f"memory://outputs-{uuid.uuid4().hex[:8]}"
        yield url
        if files.exists(url):
            files.rmtree(url)
    else:  # A fresh bucket on a local server (tests/object_stores.py).
        yield request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[request.param])


def test_write_and_figures(root):
    path = files.join(root, "a", "b", "report.json")
    outputs.check_writable(path)  # Creates the local parents; nothing on a store.
    outputs.write(path, '{"ok": true}')
    assert files.read_text(path) == '{"ok": true}'
    outputs.write(path, b"again")  # Replaced whole.
    assert files.read_bytes(path) == b"again"
    pyplot = pytest.importorskip("matplotlib.pyplot")
    figure = pyplot.figure(figsize=(1, 1))
    try:
        # The format follows the name, as figure.savefig(local_path) would.
        outputs.write_figure(files.join(root, "plots", "f.png"), figure)
        outputs.write_figure(files.join(root, "plots", "f.svg"), figure)
        outputs.write_figure(files.join(root, "plots", "noext"), figure)
    finally:
        pyplot.close(figure)
    assert files.read_bytes(files.join(root, "plots", "f.png"))[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in files.read_bytes(files.join(root, "plots", "f.svg"))[:1000]
    assert files.read_bytes(files.join(root, "plots", "noext"))[:4] == b"\x89PNG"


def test_a_directory_is_refused(root):
    outputs.write(files.join(root, "run", "x.json"), "{}")
    with pytest.raises(IsADirectoryError, match=r"it is an existing directory.*out\.json"):
        outputs.check_writable(files.join(root, "run"))


def test_a_local_parent_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(FileExistsError):
        outputs.check_writable(str(tmp_path / "taken" / "x.json"))


@pytest.mark.parametrize("bucket", ["s3_bucket", "gcs_bucket"])
def test_bad_urls_are_refused_and_nothing_is_created(bucket, request):
    scheme = request.getfixturevalue(bucket).partition("://")[0]
    missing = f"{scheme}://keras-accel-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(FileNotFoundError, match=r"bucket .* does not exist.*never creates"):
        outputs.check_writable(f"{missing}/run/bench.json")
    with pytest.raises(FileNotFoundError):
        outputs.write(f"{missing}/run/bench.json", "{}")  # The store's own error...
    assert not files.exists(missing)  # ...and no bucket made for it.
    with pytest.raises(ValueError, match="No file system can open"):
        outputs.check_writable("nosuchprotocol://bucket/x.json")
    with pytest.raises(ValueError, match="cannot be empty"):
        outputs.check_writable("")
