"""The local object-store servers of tests/object_stores.py: an object written through fsspec
lands on the server and reads back, from this process and from a process it starts, and the
environment that points clients at a server is gone after the test."""

import os
import subprocess
import sys

import fsspec
import pytest

# A child writes through fsspec with nothing but the environment it inherited, then the
# parent reads what it wrote: the server's variables must reach processes a test starts.
_CHILD = """
import sys
import fsspec

with fsspec.open(sys.argv[1], "wb") as f:
    f.write(b"from the child")
"""


def _write_and_read(bucket: str):
    payload = os.urandom(1000)
    with fsspec.open(f"{bucket}/dir/x.bin", "wb") as f:
        f.write(payload)
    with fsspec.open(f"{bucket}/dir/x.bin", "rb") as f:
        assert f.read() == payload
    fs, path = fsspec.core.url_to_fs(bucket)
    assert fs.ls(f"{path}/dir", detail=False) == [f"{path}/dir/x.bin"]


def _child_writes(url: str):
    subprocess.run([sys.executable, "-c", _CHILD, url], check=True, timeout=120)
    with fsspec.open(url, "rb") as f:
        assert f.read() == b"from the child"


def test_s3_bucket_holds_what_fsspec_writes(s3_bucket):
    assert s3_bucket.startswith("s3://")
    _write_and_read(s3_bucket)


def test_s3_object_written_by_a_child_process(s3_bucket):
    _child_writes(f"{s3_bucket}/child.txt")


def test_s3_buckets_are_fresh_and_on_the_local_server(s3_server, s3_bucket):
    import boto3

    # The object is on the server the fixture started (boto3 asked at its endpoint
    # explicitly), not on a bucket somewhere else that the environment happened to reach.
    with fsspec.open(f"{s3_bucket}/y", "wb") as f:
        f.write(b"y")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    name = s3_bucket.removeprefix("s3://")
    listed = client.list_objects_v2(Bucket=name)
    assert [item["Key"] for item in listed["Contents"]] == ["y"]
    assert s3_server.endpoint.startswith("http://127.0.0.1:")


def test_gcs_bucket_holds_what_fsspec_writes(gcs_bucket):
    assert gcs_bucket.startswith("gs://")
    _write_and_read(gcs_bucket)


def test_gcs_object_written_by_a_child_process(gcs_bucket):
    _child_writes(f"{gcs_bucket}/child.txt")


def test_gcs_emulator_reaches_tensorstore(gcs_bucket):
    # Orbax writes its arrays through tensorstore, which finds the emulator by its own variable.
    ts = pytest.importorskip("tensorstore")
    import numpy as np

    bucket = gcs_bucket.removeprefix("gs://")
    spec = {"driver": "zarr", "kvstore": {"driver": "gcs", "bucket": bucket, "path": "a/"}}
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    array = ts.open(spec, create=True, dtype=ts.float32, shape=values.shape).result()
    array.write(values).result()
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), values)
    fs, _ = fsspec.core.url_to_fs(gcs_bucket)
    assert fs.exists(f"{bucket}/a/.zarray")


def _cloud_variables() -> dict:
    # pytest's own PYTEST_CURRENT_TEST changes between setup and teardown.
    names = ("AWS_", "STORAGE_", "GOOGLE", "GCSFS_", "TENSORSTORE_", "EPATH_", "NO_GCE", "CLOUDSDK")
    return {k: v for k, v in os.environ.items() if k.startswith(names)}


@pytest.fixture
def _environment_around():
    before = _cloud_variables()
    # The server's fixture is asked for inside the test, after this one: its teardown has run
    # by the time this fixture's own teardown looks at the environment.
    yield before
    assert _cloud_variables() == before


def test_s3_environment_is_undone_after_the_test(_environment_around, request):
    before = _environment_around
    server = request.getfixturevalue("s3_server")
    assert os.environ["AWS_ENDPOINT_URL"] == server.endpoint
    assert os.environ["AWS_ENDPOINT_URL"] != before.get("AWS_ENDPOINT_URL")


def test_gcs_environment_is_undone_after_the_test(_environment_around, request):
    before = _environment_around
    server = request.getfixturevalue("gcs_server")
    assert os.environ["STORAGE_EMULATOR_HOST"] == server.endpoint
    assert os.environ["STORAGE_EMULATOR_HOST"] != before.get("STORAGE_EMULATOR_HOST")
