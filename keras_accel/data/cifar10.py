"""CIFAR-10 from local files only (binary or Python format), with a synthetic stand-in.

The benchmark seed trained on CIFAR-10 scaled to [0, 1]. keras_accel never downloads, so
`load_cifar10` reads the official archives where they already are, validates every file
(truncated or foreign files are named in the error), unpickles the Python format through an
allow-list unpickler (a pickle can run any code; a CIFAR batch needs only numpy arrays), and
otherwise falls back to seeded synthetic images of the same shape, saying so.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from keras_accel.utils.checks import check_count

ENV_VAR = "KERAS_ACCEL_CIFAR10"
NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
NUM_TRAIN = 50000
NUM_TEST = 10000
CLASS_NAMES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip

BINARY_ARCHIVE = "cifar-10-binary.tar.gz"
BINARY_DIR = "cifar-10-batches-bin"
PYTHON_ARCHIVE = "cifar-10-python.tar.gz"
PYTHON_DIR = "cifar-10-batches-py"
# Keras 3 extracts the Python archive into "<fname>-target/"; Keras 2 used the bare name.
KERAS3_PYTHON_DIR = os.path.join("cifar-10-batches-py-target", PYTHON_DIR)

_PIXELS = 32 * 32 * 3
_RECORD = 1 + _PIXELS  # binary format: 1 label byte, then 1024 R, 1024 G, 1024 B bytes
_BINARY_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6)) + ("test_batch.bin",)
_PYTHON_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


class CifarFormatError(ValueError):
    """A CIFAR-10 file exists but is truncated, corrupted, unsafe or not CIFAR-10."""


class Cifar10Data(tuple):
    """`((x_train, y_train), (x_test, y_test))`, plus where the data came from.

    Unpacks exactly like `keras.datasets.cifar10.load_data()`; the extra attributes say
    whether the arrays are real:

    Attributes:
        source: a human-readable description ("binary archive /path/..." or
            "synthetic ...; looked in: ...").
        synthetic: True when the arrays are the synthetic stand-in.
        searched: the paths looked at, in order.
    """

    source: str
    synthetic: bool
    searched: tuple[str, ...]

    def __new__(cls, train, test, *, source: str, synthetic: bool, searched: Sequence[str]):
        self = super().__new__(cls, (train, test))
        self.source = source
        self.synthetic = synthetic
        self.searched = tuple(searched)
        return self

    def __getnewargs_ex__(self):
        # Lets pickle and copy rebuild the object (tuple's default passes only the items).
        info = {"source": self.source, "synthetic": self.synthetic, "searched": self.searched}
        return (self[0], self[1]), info

    @property
    def train(self) -> tuple[np.ndarray, np.ndarray]:
        return self[0]

    @property
    def test(self) -> tuple[np.ndarray, np.ndarray]:
        return self[1]


# --------------------------------------------------------------------------- restricted pickle


def _latin1_encode(text, encoding="latin1"):
    # Python 3 pickles (protocol <= 2) store bytes as `_codecs.encode(str, "latin1")`; any other
    # codec would be a way to reach codec machinery the data never needs.
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(
            f"Refusing _codecs.encode with encoding={encoding!r}: a CIFAR-10 batch only "
            "needs latin1."
        )
    return text.encode("latin1")


def _numpy_globals() -> dict[tuple[str, str], Callable]:
    # Take the reconstruction functions from numpy's own reduce output, so the allow-list holds
    # the right objects on numpy 1.x (numpy.core) and 2.x (numpy._core) without importing
    # either private module by name.
    reconstruct = np.ndarray.__reduce__(np.zeros(1))[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    scalar = np.int64(0).__reduce__()[0]
    allowed: dict[tuple[str, str], Callable] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for package in ("numpy.core", "numpy._core"):
        allowed[(f"{package}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = frombuffer
    return allowed


_ALLOWED_GLOBALS = _numpy_globals()


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can only rebuild numpy arrays, dtypes and scalars.

    Every other global a pickle names (`os.system`, `builtins.eval`, `subprocess.Popen`...)
    is refused with `pickle.UnpicklingError`, so a tampered CIFAR-10 batch cannot run code.

    Example:
        >>> import io, pickle
        >>> data = pickle.dumps({"data": np.zeros((1, 3072), np.uint8)}, protocol=2)
        >>> RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()["data"].shape
        (1, 3072)
    """

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"Refusing to load global {module}.{name}: a CIFAR-10 batch needs only numpy "
                "arrays; the file may be malicious or corrupted."
            ) from None


# --------------------------------------------------------------------------- file parsers


def _parse_binary(data: bytes, label: str) -> tuple[np.ndarray, np.ndarray]:
    """Records of 1 label byte + 3072 channel-major pixel bytes -> (N, 32, 32, 3), (N,)."""
    if not data or len(data) % _RECORD:
        raise CifarFormatError(
            f"{label}: expected a whole number of {_RECORD}-byte CIFAR-10 binary records "
            f"(1 label byte + {_PIXELS} pixel bytes; the official file holds 10000 records, "
            f"{10000 * _RECORD} bytes). Found {len(data)} bytes ({len(data) // _RECORD} "
            f"records and {len(data) % _RECORD} bytes left over): the file is truncated or "
            "not in the CIFAR-10 binary format."
        )
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, _RECORD)
    labels = records[:, 0]
    _check_labels(labels, label)
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels


def _parse_python(data: bytes, label: str) -> tuple[np.ndarray, np.ndarray]:
    """A pickled dict {data: uint8 (N, 3072), labels: N ints} -> (N, 32, 32, 3), (N,)."""
    try:
        # encoding="bytes": the official batches were pickled by Python 2, whose str values
        # (keys and raw array bytes) must come back as bytes, not be decoded as text.
        batch = RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as error:  # any unpickling failure means a bad file
        raise CifarFormatError(
            f"{label}: not a readable CIFAR-10 Python batch (a pickled dict with 'data' and "
            f"'labels'). {type(error).__name__}: {error}"
        ) from error
    if not isinstance(batch, dict):
        raise CifarFormatError(
            f"{label}: expected a pickled dict with 'data' and 'labels'; found a "
            f"{type(batch).__name__}."
        )
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        hint = " (CIFAR-100 batches have 'fine_labels')" if "fine_labels" in batch else ""
        raise CifarFormatError(
            f"{label}: expected keys 'data' and 'labels'; found keys {sorted(map(str, batch))}"
            f"{hint}."
        )
    pixels = batch["data"]
    if not (
        isinstance(pixels, np.ndarray)
        and pixels.dtype == np.uint8
        and pixels.ndim == 2
        and pixels.shape[1] == _PIXELS
    ):
        found = (
            f"dtype={pixels.dtype}, shape={pixels.shape}"
            if isinstance(pixels, np.ndarray)
            else f"a {type(pixels).__name__}"
        )
        raise CifarFormatError(
            f"{label}: 'data' must be a uint8 array of shape (N, {_PIXELS}); found {found}."
        )
    try:
        labels = np.asarray(batch["labels"])
    except Exception as error:  # ragged or odd objects: report, not crash
        raise CifarFormatError(f"{label}: 'labels' is not a list of integers ({error}).") from None
    if labels.ndim != 1 or labels.shape[0] != pixels.shape[0] or labels.dtype.kind not in "iu":
        raise CifarFormatError(
            f"{label}: 'labels' must be {pixels.shape[0]} integers (one per image); found "
            f"dtype={labels.dtype}, shape={labels.shape}."
        )
    _check_labels(labels, label)
    images = pixels.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels.astype(np.uint8)


def _check_labels(labels: np.ndarray, label: str) -> None:
    bad = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
    if bad.size:
        raise CifarFormatError(
            f"{label}: label {int(labels[bad[0]])} at record {int(bad[0])} is outside 0..9; "
            "the file is corrupted or not CIFAR-10."
        )


# --------------------------------------------------------------------------- file sources


class _Files:
    """The six batch files of one format, readable by name, from a directory or an archive."""

    def __init__(self, kind: str, fmt: str, location: str, read: Callable[[str], bytes]):
        self.kind = kind  # "directory" or "archive", for the `source` string
        self.fmt = fmt  # "binary" or "python"
        self.location = location
        self._read = read

    @property
    def names(self) -> tuple[str, ...]:
        return _BINARY_FILES if self.fmt == "binary" else _PYTHON_FILES

    def label(self, name: str) -> str:
        if self.kind == "archive":
            return f"{self.location} (member {name})"
        return os.path.join(self.location, name)

    def load(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        parse = _parse_binary if self.fmt == "binary" else _parse_python
        return parse(self._read(name), self.label(name))


def _directory_format(path: str) -> str | None:
    for fmt, names in (("binary", _BINARY_FILES), ("python", _PYTHON_FILES)):
        present = [n for n in names if os.path.isfile(os.path.join(path, n))]
        if len(present) == len(names):
            return fmt
        if present:
            missing = [n for n in names if n not in present]
            raise CifarFormatError(
                f"{path}: incomplete CIFAR-10 {fmt} directory; has {present} but is missing "
                f"{missing}."
            )
    return None


def _open_directory(path: str, fmt: str) -> _Files:
    def read(name: str) -> bytes:
        with open(os.path.join(path, name), "rb") as f:
            return f.read()

    return _Files("directory", fmt, path, read)


def _open_archive(path: str) -> _Files:
    """Read the batch members of a (gzipped) tar in one pass; nothing is extracted to disk."""
    wanted = set(_BINARY_FILES) | set(_PYTHON_FILES)
    contents: dict[str, bytes] = {}
    try:
        # One sequential pass: seeking backwards in a gzip stream would decompress it again.
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                base = os.path.basename(member.name)
                if member.isfile() and base in wanted and base not in contents:
                    contents[base] = archive.extractfile(member).read()
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        raise CifarFormatError(
            f"{path}: cannot read it as a (gzipped) tar archive of CIFAR-10 batches "
            f"({BINARY_ARCHIVE} or {PYTHON_ARCHIVE}); it is truncated or corrupted. "
            f"{type(error).__name__}: {error}"
        ) from error
    for fmt, names in (("binary", _BINARY_FILES), ("python", _PYTHON_FILES)):
        present = [n for n in names if n in contents]
        if len(present) == len(names):
            return _Files("archive", fmt, path, contents.__getitem__)
        if present:
            missing = [n for n in names if n not in present]
            raise CifarFormatError(
                f"{path}: incomplete CIFAR-10 {fmt} archive; has {present} but is missing "
                f"{missing}."
            )
    raise CifarFormatError(
        f"{path}: a tar archive without CIFAR-10 batches; expected members "
        f"{BINARY_DIR}/data_batch_1.bin..test_batch.bin or {PYTHON_DIR}/data_batch_1.."
        f"test_batch. Found {len(contents)} matching members."
    )


def _candidates_in(directory: str) -> list[str]:
    """Where CIFAR-10 may sit inside `directory`, fastest format first."""
    return [
        os.path.join(directory, BINARY_DIR),
        os.path.join(directory, BINARY_ARCHIVE),
        os.path.join(directory, KERAS3_PYTHON_DIR),
        os.path.join(directory, PYTHON_DIR),
        os.path.join(directory, PYTHON_ARCHIVE),
    ]


def _open_path(path: str, searched: list[str], *, look_inside: bool) -> _Files | None:
    """The CIFAR-10 files at `path` (an archive or a batches directory; with `look_inside`,
    also a folder holding one), None if nothing is there. A bad file found raises
    `CifarFormatError`: a corrupted cache must be reported, not silently replaced."""
    searched.append(path)
    if os.path.isfile(path):
        return _open_archive(path)
    if not os.path.isdir(path):
        return None
    fmt = _directory_format(path)
    if fmt:
        return _open_directory(path, fmt)
    if look_inside:
        for candidate in _candidates_in(path):
            files = _open_path(candidate, searched, look_inside=False)
            if files is not None:
                return files
    return None


def default_search_dirs() -> list[str]:
    """Keras's dataset caches: `$KERAS_HOME/datasets` (or `~/.keras/datasets`), then
    `/tmp/.keras/datasets`, where Keras falls back when the home directory is read-only.

    Example:
        >>> default_search_dirs()[-1]
        '/tmp/.keras/datasets'
    """
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    dirs = [os.path.join(keras_home, "datasets"), os.path.join("/tmp", ".keras", "datasets")]
    return list(dict.fromkeys(dirs))


# --------------------------------------------------------------------------- assembling


def _take(files: _Files, names: Iterable[str], count: int | None, what: str):
    """Concatenate batches in order, reading only as many files as `count` needs."""
    images, labels, have = [], [], 0
    for name in names:
        if count is not None and have >= count:
            break
        x, y = files.load(name)
        images.append(x)
        labels.append(y)
        have += len(y)
    if count is not None and count > have:
        raise ValueError(
            f"Asked for {count} {what} samples, but {files.location} holds only {have}. "
            f"Received: {'num_samples' if what == 'training' else 'num_test_samples'}={count}"
        )
    if not images:  # count == 0: no file needed
        return np.zeros((0, *IMAGE_SHAPE), np.uint8), np.zeros((0,), np.uint8)
    x, y = np.concatenate(images), np.concatenate(labels)
    return (x, y) if count is None else (x[:count], y[:count])


def _images(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    x /= 255.0  # division, not * (1/255): keeps 255 -> exactly 1.0
    return x


def _labels(y: np.ndarray, one_hot: bool) -> np.ndarray:
    y = y.astype(np.int32)
    return np.eye(NUM_CLASSES, dtype=np.float32)[y] if one_hot else y


def _synthetic(count: int, prototypes: np.ndarray, rng: np.random.Generator):
    # Each image = 35% its class's smooth colour pattern + 65% uniform noise: in [0, 1] like
    # real pixels, learnable (the pattern), but not solved by the first step (the noise).
    labels = rng.integers(0, NUM_CLASSES, size=count).astype(np.uint8)
    images = np.empty((count, *IMAGE_SHAPE), dtype=np.float32)
    for start in range(0, count, 4096):  # chunks keep the temporaries small at 50000 images
        stop = min(start + 4096, count)
        images[start:stop] = rng.random((stop - start, *IMAGE_SHAPE), dtype=np.float32)
        images[start:stop] *= 0.65
        images[start:stop] += 0.35 * prototypes[labels[start:stop]]
    return images, labels


def synthetic_cifar10(
    num_samples: int = NUM_TRAIN, num_test_samples: int = NUM_TEST, *, seed: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Seeded stand-in images: (N, 32, 32, 3) float32 in [0, 1], uint8 labels 0..9.

    Every class has a fixed blocky colour pattern (4x4 cells of 8x8 pixels); an image is that
    pattern plus uniform noise, so a model's accuracy rises as it learns the patterns.

    Args:
        num_samples: training images.
        num_test_samples: test images.
        seed: random seed; the same arguments always give the same arrays.

    Returns:
        `((x_train, y_train), (x_test, y_test))` with integer labels.

    Example:
        >>> (x, y), _ = synthetic_cifar10(4, 2)
        >>> x.shape, x.dtype.name, bool(x.min() >= 0 and x.max() <= 1)
        ((4, 32, 32, 3), 'float32', True)
    """
    for name, value in (("num_samples", num_samples), ("num_test_samples", num_test_samples)):
        if value is None:
            raise ValueError(f"`{name}` must be an integer >= 0. Received: {name}=None")
        _check_count(name, value)
    pattern_seq, train_seq, test_seq = np.random.SeedSequence(seed).spawn(3)
    cells = np.random.default_rng(pattern_seq).random((NUM_CLASSES, 4, 4, 3), dtype=np.float32)
    prototypes = cells.repeat(8, axis=1).repeat(8, axis=2)
    train = _synthetic(num_samples, prototypes, np.random.default_rng(train_seq))
    test = _synthetic(num_test_samples, prototypes, np.random.default_rng(test_seq))
    return train, test


def _check_count(name: str, value, limit: int | None = None) -> None:
    if check_count(name, value, allow_none=True) is None:
        return
    if limit is not None and value > limit:
        raise ValueError(
            f"Asked for {value} samples, but CIFAR-10 has only {limit}. Received: {name}={value}"
        )


def load_cifar10(
    path: str | os.PathLike | None = None,
    *,
    one_hot: bool = True,
    num_samples: int | None = None,
    num_test_samples: int | None = None,
    synthetic: bool | None = None,
    search_dirs: Sequence[str | os.PathLike] | None = None,
    seed: int = 0,
) -> Cifar10Data:
    """CIFAR-10 as float32 images in [0, 1], from local files, else a synthetic stand-in.

    Where it looks, in order (the first place that exists wins):

    1. `path`, if given: `cifar-10-binary.tar.gz`, `cifar-10-python.tar.gz`, an extracted
       `cifar-10-batches-bin/` or `cifar-10-batches-py/`, or a folder holding one of these.
    2. The `KERAS_ACCEL_CIFAR10` environment variable, read the same way.
    3. Each of `search_dirs` (default: `default_search_dirs()`, Keras's dataset caches), for
       `cifar-10-batches-bin/`, `cifar-10-binary.tar.gz`,
       `cifar-10-batches-py-target/cifar-10-batches-py/` (Keras 3),
       `cifar-10-batches-py/` (Keras 2) and `cifar-10-python.tar.gz`.

    An explicit `path` or environment variable that holds no CIFAR-10 is an error, not a
    reason to fall back. A file that exists but is truncated, corrupted or of another format
    raises `CifarFormatError` naming it. Python-format batches are unpickled by
    `RestrictedUnpickler`. When nothing is found, synthetic data of the same shapes is
    returned with a warning, unless `synthetic=False`.

    Args:
        path: a CIFAR-10 archive or directory.
        one_hot: labels as float32 one-hot `(N, 10)` (the seed's `to_categorical`), else
            int32 class ids `(N,)`.
        num_samples: keep the first `num_samples` training images (None: all 50000).
        num_test_samples: keep the first `num_test_samples` test images (None: all 10000).
        synthetic: None to fall back to synthetic data when nothing is found; True to use
            synthetic data without looking; False to raise `FileNotFoundError` instead.
        search_dirs: folders to search after `path` and the environment variable.
        seed: seed of the synthetic data.

    Returns:
        A `Cifar10Data`: unpacks as `(x_train, y_train), (x_test, y_test)`; `.source`,
        `.synthetic` and `.searched` say where the data came from.

    Raises:
        CifarFormatError: a CIFAR-10 file was found but cannot be read.
        FileNotFoundError: `path` or `$KERAS_ACCEL_CIFAR10` holds no CIFAR-10, or nothing
            was found and `synthetic=False`.
        ValueError: more samples asked for than the data holds.

    Example:
        >>> data = load_cifar10(synthetic=True, num_samples=8, num_test_samples=4)
        >>> (x_train, y_train), (x_test, y_test) = data
        >>> x_train.shape, y_train.shape, data.synthetic
        ((8, 32, 32, 3), (8, 10), True)
    """
    _check_count("num_samples", num_samples)
    _check_count("num_test_samples", num_test_samples)
    searched: list[str] = []
    if synthetic is not True:
        files = None
        explicit = [("path", path), (f"${ENV_VAR}", os.environ.get(ENV_VAR) or None)]
        for what, location in explicit:
            if location is None:
                continue
            location = os.path.abspath(os.path.expanduser(os.fspath(location)))
            files = _open_path(location, searched, look_inside=True)
            if files is None:
                raise FileNotFoundError(
                    f"No CIFAR-10 at {location} (from {what}): expected {BINARY_ARCHIVE}, "
                    f"{PYTHON_ARCHIVE}, {BINARY_DIR}/ or {PYTHON_DIR}/, or a folder holding "
                    f"one of them. Received: {what}={location!r}"
                )
            break
        if files is None:
            dirs = default_search_dirs() if search_dirs is None else search_dirs
            for directory in dirs:
                directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
                for candidate in _candidates_in(directory):
                    files = _open_path(candidate, searched, look_inside=False)
                    if files is not None:
                        break
                if files is not None:
                    break
        if files is not None:
            train = _take(files, files.names[:5], num_samples, "training")
            test = _take(files, files.names[5:], num_test_samples, "test")
            return Cifar10Data(
                (_images(train[0]), _labels(train[1], one_hot)),
                (_images(test[0]), _labels(test[1], one_hot)),
                source=f"CIFAR-10 {files.fmt} {files.kind} {files.location}",
                synthetic=False,
                searched=searched,
            )
        if synthetic is False:
            raise FileNotFoundError(
                f"CIFAR-10 not found and synthetic=False. Looked in: {searched}. Set "
                f"{ENV_VAR} or pass `path` to point at {BINARY_ARCHIVE} or {PYTHON_ARCHIVE}."
            )

    _check_count("num_samples", num_samples, NUM_TRAIN)
    _check_count("num_test_samples", num_test_samples, NUM_TEST)
    train, test = synthetic_cifar10(
        NUM_TRAIN if num_samples is None else int(num_samples),
        NUM_TEST if num_test_samples is None else int(num_test_samples),
        seed=seed,
    )
    if synthetic is None:
        source = f"synthetic CIFAR-10 stand-in (seed={seed}): no CIFAR-10 found; looked in: "
        source += ", ".join(searched) if searched else "(nowhere)"
        warnings.warn(f"{source}. Set {ENV_VAR} or pass `path` to use the real data.", stacklevel=2)
    else:
        source = f"synthetic CIFAR-10 stand-in (seed={seed}): requested with synthetic=True"
    return Cifar10Data(
        (train[0], _labels(train[1], one_hot)),
        (test[0], _labels(test[1], one_hot)),
        source=source,
        synthetic=True,
        searched=searched,
    )
