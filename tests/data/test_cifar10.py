"""load_cifar10 reads tiny archives written in the real formats, refuses bad or unsafe files,
and falls back to learnable synthetic data that says where it looked."""

import io
import os
import pickle
import struct
import tarfile

import numpy as np
import pytest

from keras_accel.data import cifar10
from keras_accel.data.cifar10 import (
    CifarFormatError,
    RestrictedUnpickler,
    load_cifar10,
    synthetic_cifar10,
)

PER_FILE = 3  # records per batch file: tiny, but the real record layout
TRAIN_NAMES = [f"data_batch_{i}" for i in range(1, 6)]
ALL_NAMES = [*TRAIN_NAMES, "test_batch"]


@pytest.fixture(autouse=True)
def _no_cifar_env(monkeypatch):
    # A developer's real $KERAS_ACCEL_CIFAR10 must not leak into these tests.
    monkeypatch.delenv(cifar10.ENV_VAR, raising=False)


def _batches(seed=0):
    """name -> (uint8 images (n, 32, 32, 3), labels (n,)), distinct per file."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in ALL_NAMES:
        images = rng.integers(0, 256, size=(PER_FILE, 32, 32, 3), dtype=np.uint8)
        images[0, 0, 0] = (0, 255, 7)  # the extremes must map to exactly 0.0 and 1.0
        out[name] = (images, rng.integers(0, 10, size=PER_FILE).astype(np.uint8))
    return out


def _binary_record_bytes(images, labels):
    # The official layout: 1 label byte, then the 1024 red, 1024 green, 1024 blue bytes.
    planes = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    return np.concatenate([labels[:, None], planes], axis=1).astype(np.uint8).tobytes()


class _Python2Pickler(pickle._Pickler):
    """Writes what cPickle wrote in 2009: bytes as BINSTRING, numpy under `numpy.core`."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str
    # Python 2 had one str type: even numpy's dtype state ('u1', '|') was a byte string.
    dispatch[str] = lambda self, obj: self._save_py2_str(obj.encode("latin1"))

    def save_global(self, obj, name=None):
        module = getattr(obj, "__module__", "")
        if module.startswith("numpy._core"):
            module = module.replace("numpy._core", "numpy.core")
            self.write(pickle.GLOBAL + f"{module}\n{obj.__name__}\n".encode())
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def _python_batch_bytes(images, labels, protocol):
    batch = {
        b"batch_label": b"training batch 1 of 5",
        b"labels": [int(v) for v in labels],
        b"data": images.transpose(0, 3, 1, 2).reshape(len(images), -1).copy(),
        b"filenames": [f"img_{i}.png".encode() for i in range(len(labels))],
    }
    if protocol == "py2":
        stream = io.BytesIO()
        _Python2Pickler(stream, protocol=2).dump(batch)
        return stream.getvalue()
    return pickle.dumps(batch, protocol=protocol)


def _write_dir(directory, batches, fmt="binary", protocol="py2"):
    directory.mkdir(parents=True, exist_ok=True)
    for name, (images, labels) in batches.items():
        if fmt == "binary":
            (directory / f"{name}.bin").write_bytes(_binary_record_bytes(images, labels))
        else:
            (directory / name).write_bytes(_python_batch_bytes(images, labels, protocol))
    return directory


def _write_tar(path, batches, fmt="binary"):
    folder = "cifar-10-batches-bin" if fmt == "binary" else "cifar-10-batches-py"
    with tarfile.open(path, "w:gz") as archive:
        extra = {"readme.html": b"<html></html>", "batches.meta.txt": b"airplane\n"}
        for name, (images, labels) in batches.items():
            if fmt == "binary":
                extra[f"{name}.bin"] = _binary_record_bytes(images, labels)
            else:
                extra[name] = _python_batch_bytes(images, labels, "py2")
        for name, payload in extra.items():
            info = tarfile.TarInfo(f"{folder}/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    return path


def _assert_matches(data, batches, one_hot=True):
    (x_train, y_train), (x_test, y_test) = data
    images = np.concatenate([batches[n][0] for n in TRAIN_NAMES])
    labels = np.concatenate([batches[n][1] for n in TRAIN_NAMES])
    assert x_train.shape == (5 * PER_FILE, 32, 32, 3) and x_train.dtype == np.float32
    np.testing.assert_array_equal(x_train, images.astype(np.float32) / 255.0)
    np.testing.assert_array_equal(x_test, batches["test_batch"][0].astype(np.float32) / 255.0)
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    if one_hot:
        assert y_train.shape == (5 * PER_FILE, 10) and y_train.dtype == np.float32
        np.testing.assert_array_equal(y_train.argmax(axis=1), labels)
        np.testing.assert_array_equal(y_test.argmax(axis=1), batches["test_batch"][1])
    else:
        assert y_train.dtype == np.int32
        np.testing.assert_array_equal(y_train, labels)
        np.testing.assert_array_equal(y_test, batches["test_batch"][1])
    assert data.synthetic is False


# --------------------------------------------------------------------------- real formats


def test_binary_archive(tmp_path):
    batches = _batches()
    archive = _write_tar(tmp_path / "cifar-10-binary.tar.gz", batches)
    data = load_cifar10(archive, search_dirs=[])
    _assert_matches(data, batches)
    assert data.source == f"CIFAR-10 binary archive {archive}"


def test_extracted_binary_directory_with_int_labels(tmp_path):
    batches = _batches(1)
    directory = _write_dir(tmp_path / "cifar-10-batches-bin", batches)
    _assert_matches(load_cifar10(directory, one_hot=False, search_dirs=[]), batches, one_hot=False)


@pytest.mark.parametrize("protocol", ["py2", 2, pickle.HIGHEST_PROTOCOL])
def test_python_batches_in_the_keras3_cache(tmp_path, protocol):
    batches = _batches(2)
    cache = tmp_path / "datasets"
    _write_dir(
        cache / "cifar-10-batches-py-target" / "cifar-10-batches-py", batches, "python", protocol
    )
    data = load_cifar10(search_dirs=[cache])
    _assert_matches(data, batches)
    assert "python directory" in data.source and "cifar-10-batches-py-target" in data.source


def test_python_archive(tmp_path):
    batches = _batches(3)
    archive = _write_tar(tmp_path / "cifar-10-python.tar.gz", batches, "python")
    _assert_matches(load_cifar10(archive, search_dirs=[]), batches)


def test_folder_holding_an_archive(tmp_path):
    batches = _batches(4)
    _write_tar(tmp_path / "cifar-10-binary.tar.gz", batches)
    _assert_matches(load_cifar10(tmp_path, search_dirs=[]), batches)


# --------------------------------------------------------------------------- search order


def test_search_order_path_then_env_then_caches(tmp_path, monkeypatch):
    first, second, third = _batches(5), _batches(6), _batches(7)
    explicit = _write_dir(tmp_path / "explicit" / "cifar-10-batches-bin", first)
    from_env = _write_dir(tmp_path / "env" / "cifar-10-batches-bin", second)
    cache = tmp_path / "cache"
    _write_dir(cache / "cifar-10-batches-bin", third)
    monkeypatch.setenv(cifar10.ENV_VAR, str(from_env))

    _assert_matches(load_cifar10(explicit, search_dirs=[cache]), first)
    _assert_matches(load_cifar10(search_dirs=[cache]), second)
    monkeypatch.delenv(cifar10.ENV_VAR)
    _assert_matches(load_cifar10(search_dirs=[cache]), third)


def test_binary_is_preferred_over_python_in_one_cache(tmp_path):
    binary, python = _batches(8), _batches(9)
    _write_dir(tmp_path / "cifar-10-batches-py", python, "python")
    _write_dir(tmp_path / "cifar-10-batches-bin", binary)
    _assert_matches(load_cifar10(search_dirs=[tmp_path]), binary)


def test_explicit_path_without_cifar_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="from path"):
        load_cifar10(tmp_path / "nowhere", search_dirs=[])
    monkeypatch.setenv(cifar10.ENV_VAR, str(tmp_path / "also_nowhere"))
    with pytest.raises(FileNotFoundError, match=r"\$KERAS_ACCEL_CIFAR10"):
        load_cifar10(search_dirs=[])


# --------------------------------------------------------------------------- subsetting


def test_num_samples_takes_the_first_images_across_files(tmp_path):
    batches = _batches(10)
    directory = _write_dir(tmp_path / "cifar-10-batches-bin", batches)
    (x, y), (x_test, _) = load_cifar10(directory, num_samples=7, num_test_samples=2, one_hot=False)
    images = np.concatenate([batches[n][0] for n in TRAIN_NAMES])[:7]
    np.testing.assert_array_equal(x, images / np.float32(255))
    assert y.shape == (7,) and x_test.shape == (2, 32, 32, 3)
    (x, y), (x_test, y_test) = load_cifar10(directory, num_samples=0, num_test_samples=0)
    assert x.shape == (0, 32, 32, 3) and y.shape == (0, 10) and x_test.shape == (0, 32, 32, 3)


def test_asking_more_samples_than_exist_is_a_clear_error(tmp_path):
    directory = _write_dir(tmp_path / "cifar-10-batches-bin", _batches())
    with pytest.raises(ValueError, match=r"Asked for 16 training samples.*holds only 15"):
        load_cifar10(directory, num_samples=16)
    with pytest.raises(ValueError, match=r"num_test_samples=4"):
        load_cifar10(directory, num_test_samples=4)
    with pytest.raises(ValueError, match="only 50000"):
        load_cifar10(synthetic=True, num_samples=50001)
    with pytest.raises(ValueError, match="num_samples"):
        load_cifar10(synthetic=True, num_samples=-1)


# --------------------------------------------------------------------------- bad files


def test_truncated_binary_file_names_file_and_sizes(tmp_path):
    directory = _write_dir(tmp_path / "cifar-10-batches-bin", _batches())
    victim = directory / "data_batch_2.bin"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(CifarFormatError) as info:
        load_cifar10(directory)
    message = str(info.value)
    assert str(victim) in message
    assert "3073-byte" in message and f"Found {3 * 3073 - 100} bytes" in message


def test_binary_label_out_of_range(tmp_path):
    directory = _write_dir(tmp_path / "cifar-10-batches-bin", _batches())
    records = bytearray((directory / "test_batch.bin").read_bytes())
    records[3073] = 200  # label byte of the second record
    (directory / "test_batch.bin").write_bytes(bytes(records))
    with pytest.raises(CifarFormatError, match=r"test_batch.bin: label 200 at record 1"):
        load_cifar10(directory)


def test_truncated_archive(tmp_path):
    archive = _write_tar(tmp_path / "cifar-10-binary.tar.gz", _batches())
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    with pytest.raises(CifarFormatError, match=r"cifar-10-binary.tar.gz: cannot read it as"):
        load_cifar10(archive)


def test_file_that_is_not_an_archive(tmp_path):
    bogus = tmp_path / "cifar-10-binary.tar.gz"
    bogus.write_bytes(b"this is not a tar.gz" * 10)
    with pytest.raises(CifarFormatError, match="truncated or corrupted"):
        load_cifar10(search_dirs=[tmp_path])


def test_incomplete_directory_lists_missing_files(tmp_path):
    directory = _write_dir(tmp_path / "cifar-10-batches-bin", _batches())
    (directory / "test_batch.bin").unlink()
    with pytest.raises(CifarFormatError, match=r"missing \['test_batch.bin'\]"):
        load_cifar10(directory)


def test_archive_without_batches(tmp_path):
    archive = tmp_path / "other.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("hello.txt")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(CifarFormatError, match="without CIFAR-10 batches"):
        load_cifar10(archive)


@pytest.mark.parametrize(
    "payload, match",
    [
        (pickle.dumps([1, 2, 3], protocol=2), "found a list"),
        (pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [1]}), "fine_"),
        (pickle.dumps({"data": np.zeros((1, 3072), np.float32), "labels": [1]}), "float32"),
        (pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [1]}), "2 integers"),
        (pickle.dumps({"data": np.zeros((1, 3072), np.uint8), "labels": [11]}), "label 11"),
        (_python_batch_bytes(*_batches()["test_batch"], "py2")[:500], "not a readable"),
    ],
)
def test_bad_python_batches_name_the_file(tmp_path, payload, match):
    directory = _write_dir(tmp_path / "cifar-10-batches-py", _batches(), "python")
    (directory / "data_batch_1").write_bytes(payload)
    with pytest.raises(CifarFormatError, match=match) as info:
        load_cifar10(directory)
    assert str(directory / "data_batch_1") in str(info.value)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running(tmp_path):
    directory = _write_dir(tmp_path / "cifar-10-batches-py", _batches(), "python")
    marker = tmp_path / "pwned"
    evil = {b"data": _Exploit(marker), b"labels": [0]}
    (directory / "data_batch_1").write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(CifarFormatError, match=r"Refusing to load global (os|posix)\.system"):
        load_cifar10(directory)
    assert not marker.exists()


@pytest.mark.parametrize(
    "payload",
    [
        b"cbuiltins\neval\n(S'1+1'\ntR.",  # protocol 0 GLOBAL of builtins.eval
        b"c_codecs\nencode\n(Vabc\nVrot13\ntR.",  # a codec other than latin1
    ],
)
def test_restricted_unpickler_refuses_other_globals(payload):
    with pytest.raises(pickle.UnpicklingError, match="Refusing"):
        RestrictedUnpickler(io.BytesIO(payload)).load()


# --------------------------------------------------------------------------- synthetic


def test_synthetic_fallback_says_where_it_looked(tmp_path):
    with pytest.warns(UserWarning, match="synthetic"):
        data = load_cifar10(search_dirs=[tmp_path], num_samples=20, num_test_samples=10)
    (x, y), (x_test, y_test) = data
    assert data.synthetic is True
    assert x.shape == (20, 32, 32, 3) and x.dtype == np.float32 and y.shape == (20, 10)
    assert x_test.shape == (10, 32, 32, 3) and y_test.shape == (10, 10)
    assert x.min() >= 0.0 and x.max() <= 1.0
    assert "synthetic" in data.source
    assert str(tmp_path / "cifar-10-batches-bin") in data.source
    assert str(tmp_path / "cifar-10-python.tar.gz") in data.searched


def test_synthetic_false_refuses_and_true_does_not_search(tmp_path):
    with pytest.raises(FileNotFoundError, match="synthetic=False"):
        load_cifar10(search_dirs=[tmp_path], synthetic=False)
    _write_dir(tmp_path / "cifar-10-batches-bin", _batches())
    data = load_cifar10(
        search_dirs=[tmp_path], synthetic=True, num_samples=2, num_test_samples=1, one_hot=False
    )
    assert data.synthetic and data.searched == () and data.train[1].dtype == np.int32


def test_result_survives_pickle_with_its_source():
    data = load_cifar10(synthetic=True, num_samples=2, num_test_samples=1)
    again = pickle.loads(pickle.dumps(data))
    assert again.source == data.source and again.synthetic and again.searched == ()
    np.testing.assert_array_equal(again.train[0], data.train[0])


def test_synthetic_data_is_seeded_and_learnable():
    (x, y), (x_test, y_test) = synthetic_cifar10(1000, 200, seed=0)
    (x_again, _), _ = synthetic_cifar10(1000, 200, seed=0)
    (x_other, _), _ = synthetic_cifar10(1000, 200, seed=1)
    np.testing.assert_array_equal(x, x_again)
    assert not np.array_equal(x, x_other)
    assert set(np.unique(y)) == set(range(10))
    # Nearest class mean, fitted on train: far above the 10% of chance on test.
    means = np.stack([x[y == c].mean(axis=0) for c in range(10)]).reshape(10, -1)
    flat = x_test.reshape(len(x_test), -1)
    distances = ((flat[:, None, :] - means[None]) ** 2).sum(axis=-1)
    assert (distances.argmin(axis=1) == y_test).mean() > 0.9
