"""Local object-store servers for the tests: s3:// on moto's server, gs:// on a GCS emulator.

Registered for every test by `pytest_plugins` in tests/conftest.py. Each server listens on
127.0.0.1 only, on a port the OS picks, once per session (starting one costs about a second);
the environment that points the clients at it is set per test and undone after it, so that a
test that does not ask for a bucket sees the machine's environment unchanged (and the
suite's guard against leaked variables holds):

    def test_something(s3_bucket):        # "s3://<fresh bucket>"
        with fsspec.open(f"{s3_bucket}/x", "wb") as f: ...

The variables reach the processes a test starts too (`keras-accel launch`, a killed fit), as
a user's would. Each fixture skips with the install command when its packages are missing.
"""

import contextlib
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
        return __import__(module, fromlist=["_"])
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
