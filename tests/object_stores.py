"""Local object-store servers for the tests: s3:// on moto's server, gs:// on a GCS emulator.

Registered for every test by `pytest_plugins` in tests/conftest.py. Each server listens on
127.0.0.1 only, on a port the OS picks, once per session (moto's takes about a second);
the environment that points the clients at it is set per test and undone after it, so that a
test that does not ask for a bucket sees the machine's environment unchanged (and the
suite's guard against leaked variables holds):

    def test_something(s3_bucket):        # "s3://<fresh bucket>"; gcs_bucket: "gs://..."
        with fsspec.open(f"{s3_bucket}/x", "wb") as f: ...

`s3_server` / `gcs_server` give the server itself (its `endpoint` and the `env` it sets).

The variables reach the processes a test starts too (`keras-accel launch`, a killed fit), as
a user's would. Each fixture skips with the install command when its packages are missing.
"""

import contextlib
import importlib
import logging
import os
import uuid
from dataclasses import dataclass, field

import pytest

_INSTALL = 'pip install -c constraints.txt -e ".[all,test]" (the README\'s test command)'


@dataclass(frozen=True)
class Server:
    """A running local server: its URL and the environment variables that point clients at it."""

    protocol: str
    endpoint: str
    env: dict = field(default_factory=dict)


def _require(module: str, what: str):
    """The module, or a skip naming what is missing and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        pytest.skip(f"{what} is not installed ({error}); install it with {_INSTALL}")


def _clear_cached_filesystems(*classes):
    """fsspec keeps one filesystem per class and arguments, built with the environment of the
    moment: a cached one made before (or after) a server's variables would talk to the wrong
    endpoint, so each test that sets or unsets them starts from fresh instances."""
    for cls in classes:
        cls.clear_instance_cache()


# -- s3:// -------------------------------------------------------------------------------------

# What botocore (boto3, s3fs through aiobotocore) reads: the endpoint (botocore >= 1.31 honours
# AWS_ENDPOINT_URL), dummy credentials (moto accepts any), a region without a location
# constraint. The machine's own AWS configuration must not take part: no profile, no config or
# credentials file, no probe of EC2's metadata service (a 1 s timeout per client elsewhere).
_S3_UNSET = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CA_BUNDLE",
)


@pytest.fixture(scope="session")
def _s3_service():
    """moto's server in a thread of this process, on 127.0.0.1 and a free port; stopped at the
    end of the session."""
    _require("s3fs", "s3fs (the `remote` extra)")
    moto_server = _require("moto.server", "moto's server (moto[server])")
    # Port 0: the OS picks a free port when the server binds, so parallel runs never collide.
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        yield Server("s3", endpoint, env)
    finally:
        server.stop()


@pytest.fixture
def s3_server(_s3_service, monkeypatch):
    """The session's S3 server, with this process's environment (and so its children's)
    pointing botocore, boto3 and s3fs at it for the test; undone afterwards."""
    import s3fs

    for name in _S3_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in _s3_service.env.items():
        monkeypatch.setenv(name, value)
    _clear_cached_filesystems(s3fs.S3FileSystem)
    yield _s3_service
    _clear_cached_filesystems(s3fs.S3FileSystem)


def _bucket_name() -> str:
    # S3's rules: 3-63 characters, lower-case letters, digits and hyphens.
    return f"keras-accel-{uuid.uuid4().hex[:16]}"


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the test's S3 server: yields "s3://<name>". Removed with its
    objects afterwards."""
    import s3fs

    fs = s3fs.S3FileSystem()
    url = f"s3://{_bucket_name()}"
    fs.mkdir(url)
    yield url
    with contextlib.suppress(FileNotFoundError):
        fs.rm(url, recursive=True)


# -- gs:// -------------------------------------------------------------------------------------

# gcp-storage-emulator (pure Python, from pip) speaks GCS's JSON API over plain HTTP. What each
# client reads to reach it:
# - gcsfs and google-cloud-storage: STORAGE_EMULATOR_HOST.
# - tensorstore (Orbax's arrays): TENSORSTORE_GCS_HTTP_URL, and GOOGLE_AUTH_TOKEN_FOR_TESTING
#   instead of looking for credentials (a probe of GCE's metadata server otherwise).
# - gcsfs >= 2026.3 by default first asks GCS's gRPC control plane for the bucket's layout
#   (zonal, hierarchical), on every operation while the answer is unknown; the emulator has no
#   gRPC, so each call waited 60 s before falling back. GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
#   keeps the plain JSON-API client (read when gcsfs is imported: children; this process swaps
#   the registered class below).
# - etils.epath (Orbax's metadata files) writes gs:// through tf.io.gfile whenever TensorFlow is
#   installed, and TensorFlow's GCS client has its endpoint compiled in
#   (www.googleapis.com/storage/v1): EPATH_USE_TF=false sends it through fsspec (gcsfs).
# And no machine credentials: no GCE metadata probe, no gcloud configuration.
_GCS_UNSET = ("GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST", "GCE_METADATA_IP")


@pytest.fixture(scope="session")
def _gcs_service():
    """gcp-storage-emulator in a thread of this process, in memory, on 127.0.0.1 and a free
    port; stopped at the end of the session."""
    _require("gcsfs", "gcsfs (the `remote` extra)")
    emulator = _require("gcp_storage_emulator.server", "gcp-storage-emulator")
    # The emulator logs each 404 as an error, and a missing object is an ordinary answer (Orbax
    # and gcsfs probe for objects): such lines would crowd a failing test's captured log.
    log = logging.getLogger("gcp_storage_emulator")
    level = log.level
    log.setLevel(logging.CRITICAL)
    server = emulator.create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    try:
        # The emulator has no accessor for the port the OS chose: its HTTP server has it.
        port = server._api._httpd.server_address[1]
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            "STORAGE_EMULATOR_HOST": endpoint,
            "TENSORSTORE_GCS_HTTP_URL": endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "EPATH_USE_TF": "false",
            "NO_GCE_CHECK": "true",
            # gcloud's directory, where application-default credentials would be: none there.
            "CLOUDSDK_CONFIG": os.devnull,
            "GOOGLE_CLOUD_PROJECT": "keras-accel-tests",
        }
        yield Server("gs", endpoint, env)
    finally:
        server.stop()
        log.setLevel(level)


@pytest.fixture
def gcs_server(_gcs_service, monkeypatch):
    """The session's GCS emulator, with this process's environment (and so its children's)
    pointing gcsfs, google-cloud-storage, tensorstore and etils at it for the test; undone
    afterwards."""
    import gcsfs.core

    for name in _GCS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in _gcs_service.env.items():
        monkeypatch.setenv(name, value)
    # gcsfs chose its class when this process imported it, maybe before the variable above:
    # fsspec's registry takes the plain one for the test (the entry is removed afterwards).
    registry = importlib.import_module("fsspec.registry")._registry
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(registry, protocol, gcsfs.core.GCSFileSystem)
    # etils caches whether it may use TensorFlow; the test's answer must follow EPATH_USE_TF.
    _clear_etils_backend_cache()
    _clear_cached_filesystems(gcsfs.core.GCSFileSystem, gcsfs.GCSFileSystem)
    yield _gcs_service
    _clear_cached_filesystems(gcsfs.core.GCSFileSystem, gcsfs.GCSFileSystem)
    _clear_etils_backend_cache()


def _clear_etils_backend_cache():
    with contextlib.suppress(ImportError, AttributeError):
        importlib.import_module("etils.epath.gpath")._is_tf_installed.cache_clear()


@pytest.fixture
def gcs_bucket(gcs_server):
    """A fresh, empty bucket on the test's GCS emulator: yields "gs://<name>". Removed with its
    objects afterwards."""
    import fsspec

    fs = fsspec.filesystem("gs")
    name = _bucket_name()
    fs.mkdir(name)  # gcsfs creates a bucket from its bare name ("gs://x" looks like a folder)
    url = f"gs://{name}"
    yield url
    with contextlib.suppress(FileNotFoundError):
        fs.rm(url, recursive=True)
