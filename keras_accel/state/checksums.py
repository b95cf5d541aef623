"""Each checkpoint file's size and CRC32C, recorded when a backup commits and checked before it
is restored: a damaged backup is found before any of it reaches the model.

Orbax and DCP read a flipped or truncated byte back without a word (Orbax's OCDBT store
compresses nothing and checks nothing of the data; DCP reads raw byte ranges), and a run
resumed from such a backup trains on with NaN or wild weights. tf.train checks its own
(every tensor's CRC32C in the index, every index block's), so it needs no record here.

The record is one JSON file in the step, `keras_accel.checksums.json`:
`{"algorithm": "crc32c", "files": {"<name relative to the step>": {"size": N, "crc32c":
"<8 hex digits>"}}}`, written by the engine's commit protocol before the step commits
(Orbax: after its handlers finalize the step, before the rename or commit marker; DCP:
before its `.metadata`; the staged path: in its `COMMITTED` marker), in the thread that
writes the step, never the training thread. A step without a record is one written before
keras_accel recorded them: it restores unchecked, as it always did.

CRC32C is the checksum storage uses for exactly this (TensorFlow's checkpoints, GCS objects,
ext4 metadata), and `google-crc32c` computes it with the CPU's CRC32 instructions: 12.7 GB/s
on this machine, against 4.0 GB/s for zlib's CRC-32 and 0.9-1.7 GB/s for BLAKE2b and
SHA-256 (100 MB, one core); docs/benchmarks.md has what it costs a save and a restore. On
GCS the objects' own CRC32C is read instead (`digest`); other stores (s3://) read the
files back.

**Signed records.** A CRC32C finds damage, not tampering: anyone who can write the folder
can change a file and re-seal its record. With a signing key (`BackupAndRestore(...,
signing_key=...)`, or `KERAS_ACCEL_SIGNING_KEY`) the record also holds each file's SHA-256
and `"hmac-sha256"`: an HMAC-SHA256, under the key, of the step number and every recorded
file's name, size, CRC32C and SHA-256 (`sign`). A CRC32C alone under a signature would not
do: it is linear, and four chosen bytes give any changed file the CRC32C of the original,
so a file could be swapped under a genuine signed record. The SHA-256 is computed in the
same read as the CRC32C, at about 1-2 GB/s instead of 12.7 (docs/benchmarks.md); on GCS
signed files are read back instead of taking the objects' CRC32C from their metadata.

A restore with the key (`verify(..., key=, step=)`) refuses as `Tampered` (a `Damaged`, so
the step is set aside as damaged ones are): a step without a record, a record without a
signature or whose signature does not verify for this step (re-sealed without the key,
signed with another, or copied from another step), a file of the step the record does not
list, and a file whose SHA-256 differs from the signed one. The key is never written or
logged, and signatures are compared with `hmac.compare_digest`. Without a key nothing is
signed or checked: records are as before.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time

import google_crc32c

from keras_accel.state import files

RECORD = "keras_accel.checksums.json"
ALGORITHM = "crc32c"
STRONG = "sha256"  # Each file's SHA-256, recorded beside its CRC32C where records are signed.
SIGNATURE = "hmac-sha256"  # The record's field holding its HMAC, when signed.
KEY_VARIABLE = "KERAS_ACCEL_SIGNING_KEY"  # The signing key, for launchers.
# Where a damaged step is kept, out of every engine's listing: `<backup_dir>/damaged/`.
DAMAGED = "damaged"
_CHUNK = 8 * 2**20  # Read in pieces: a checkpoint file may be larger than memory allows.


class Damaged(Exception):
    """A file of a checkpoint differs from what its commit recorded (or is gone).

    Attributes:
        file: the file's name relative to the step.
        mismatch: what differs, in words ("crc32c 1a2b3c4d, recorded 5e6f7a8b").
    """

    def __init__(self, file: str, mismatch: str):
        super().__init__(f"{file}: {mismatch}")
        self.file = file
        self.mismatch = mismatch


class Tampered(Damaged):
    """A step's record is missing, unsigned or forged where a signing key is set, or the
    step holds a file its signed record does not list: refused, and set aside as a
    damaged step is. `tampered` tells the two apart in messages."""

    tampered = True


def signing_key(given: bytes | str | None) -> bytes | None:
    """The signing key: `given`, else the environment's `KERAS_ACCEL_SIGNING_KEY`, else
    None (records unsigned). A str is its UTF-8 bytes. Messages never repeat the key."""
    source = "signing_key"
    if given is None:
        given = os.environ.get(KEY_VARIABLE) or None
        source = f"the environment variable {KEY_VARIABLE}"
    if given is None:
        return None
    if isinstance(given, str):
        given = given.encode("utf-8")
    if not isinstance(given, (bytes, bytearray)):
        raise TypeError(
            f"BackupAndRestore: {source} must be bytes or a str. Received: an object of "
            f"type {type(given).__name__}."
        )
    if not given:
        raise ValueError(
            f"BackupAndRestore: {source} is empty; give a key, or None to sign nothing."
        )
    return bytes(given)


def sign(key: bytes, step: int, entries: dict) -> str:
    """The HMAC-SHA256 (hex) under `key` of step `step`'s record entries
    (`{name: {"size": N, "crc32c": hex}}`): the step number is signed too, so a record
    copied to another step does not verify there."""
    message = json.dumps(
        {"step": int(step), "files": entries}, sort_keys=True, separators=(",", ":")
    )
    return hmac.new(key, message.encode("utf-8"), hashlib.sha256).hexdigest()


def authenticate(recorded: dict | None, key: bytes, step: int, name: str = RECORD) -> None:
    """Check that `recorded` (the record of step `step`, None where there is none) carries a
    signature that verifies under `key`.

    Raises:
        Tampered: no record, no signature, or one that does not verify for this step.
    """
    if recorded is None:
        raise Tampered(
            name,
            "missing, and a signing key is set: a step without a signed record is refused "
            "(written without a key, by keras_accel before records, or its record removed)",
        )
    signature = recorded.get(SIGNATURE)
    if not isinstance(signature, str):
        raise Tampered(
            name,
            "unsigned, and a signing key is set: the record was written without a key (or "
            "re-sealed by someone without it); refused as tampered",
        )
    if not hmac.compare_digest(sign(key, step, recorded["files"]).encode(), signature.encode()):
        raise Tampered(
            name,
            f"its HMAC-SHA256 does not verify for step {int(step)} under the signing key "
            "given: re-sealed by someone without the key, copied from another step, or "
            "signed with another key; refused as tampered",
        )


def digest(path: str, strong: bool = False) -> dict:
    """`{"size": bytes, "crc32c": "<8 hex digits>"}` of the file `path` (local or a URL),
    and with `strong` its `"sha256"` too, from the same read.

    On GCS the object's own CRC32C, which GCS computes from the bytes it stores (and checks
    each upload against), is read from its metadata: the same number, without downloading
    the object (a step of several GB read back after every save, and again before a
    restore). Elsewhere, and for a SHA-256, the file is read."""
    if files.scheme(path) in ("gs", "gcs") and not strong:
        stored = files.info(path)
        if stored.get("crc32c"):
            crc = base64.b64decode(stored["crc32c"]).hex()
            return {"size": int(stored["size"]), ALGORITHM: crc}
    checksum = google_crc32c.Checksum()
    sha = hashlib.sha256() if strong else None
    size = 0
    with _open(path) as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            checksum.update(chunk)
            if sha is not None:
                sha.update(chunk)
            size += len(chunk)
    found = {"size": size, ALGORITHM: checksum.digest().hex()}
    if sha is not None:
        found[STRONG] = sha.hexdigest()
    return found


def digest_bytes(data: bytes) -> str:
    """The CRC32C of `data`, as `digest` writes it."""
    return google_crc32c.Checksum(data).digest().hex()


def _open(path: str):
    if not files.is_remote(path):
        return open(files.local_path(path), "rb")
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    return fs.open(inner, "rb", block_size=_CHUNK)


def names_under(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The files under the directory `root` (local or a URL), as `/`-separated names
    relative to it, sorted; names in `skip` (at any depth) and the record left out."""
    skip = (*skip, RECORD)
    if not files.is_remote(root):
        root = files.local_path(root)
        found = []
        for folder, _, names in os.walk(root):
            for name in names:
                if name not in skip:
                    relative = os.path.relpath(os.path.join(folder, name), root)
                    found.append(relative.replace(os.sep, "/"))
        return sorted(found)
    import fsspec

    fs, inner = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    inner = inner.rstrip("/")
    return sorted(
        path[len(inner) + 1 :] for path in fs.find(inner) if path.rsplit("/", 1)[-1] not in skip
    )


def record(root: str, names: list[str], strong: bool = False) -> dict:
    """The record of the files `names` under `root` (with `strong`: their SHA-256 too)."""
    return {
        "algorithm": ALGORITHM,
        "files": {name: digest(files.join(root, *name.split("/")), strong) for name in names},
    }


def seal(
    root: str,
    skip: tuple[str, ...] = (),
    key: bytes | None = None,
    step: int | None = None,
    names: list[str] | None = None,
    into: str = RECORD,
) -> dict:
    """Write the record of every file under `root` (but `skip`; or of the files `names`)
    into `root/into`, atomically, signed for step `step` where `key` is given; returns it."""
    written = record(root, names_under(root, skip) if names is None else names, key is not None)
    if key is not None:
        written[SIGNATURE] = sign(key, step, written["files"])
    files.write_atomic(files.join(root, into), json.dumps(written, sort_keys=True))
    return written


def read(root: str, name: str = RECORD) -> dict | None:
    """The record `name` in `root`, or None where the step has none (written before
    records)."""
    path = files.join(root, name)
    try:
        text = files.read_text(path)
    except FileNotFoundError:
        return None
    try:
        found = json.loads(text)
        found["files"].items()  # noqa: B018 - the shape is what is checked.
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise Damaged(name, f"unreadable ({type(error).__name__}: {error})") from error
    return found


def verify(
    root: str,
    recorded: dict | None = None,
    key: bytes | None = None,
    step: int | None = None,
    present: list[str] | None = None,
    name: str = RECORD,
) -> bool:
    """Check every file the record of `root` lists (`recorded`, else the one in `root`):
    True when all match, False where `root` has no record (nothing to check against).

    With `key`: the record must be signed for step `step` (`authenticate`), and the files
    `present` in the step (default: every file under `root` but the record) must all be
    listed in it: a file added beside the signed ones is refused too. `name`: the record's
    name in messages.

    Raises:
        Tampered: with `key`, as `authenticate`, or a file the record does not list.
        Damaged: the first file that is missing, or whose size or CRC32C differs.
    """
    recorded = read(root) if recorded is None else recorded
    if key is not None:
        authenticate(recorded, key, step, name)
        present = names_under(root) if present is None else present
        unlisted = sorted(set(present) - set(recorded["files"]))
        if unlisted:
            raise Tampered(
                unlisted[0],
                "is in the step but not in its signed record: added after the step was "
                "signed; refused as tampered",
            )
    if recorded is None:
        return False
    for name, expected in sorted(recorded["files"].items()):
        check(files.join(root, *name.split("/")), name, expected)
    return True


def check(path: str, name: str, expected: dict) -> None:
    """Compare the file `path` (named `name` in messages) with its recorded entry (its size
    alone where the entry has no CRC32C: a staged marker written before they were recorded;
    its SHA-256 too where the entry has one: a signed record).

    Raises:
        Damaged: it is missing, or its size, CRC32C or SHA-256 differs.
    """
    strong = expected.get(STRONG) is not None
    try:
        found = digest(path, strong)
    except FileNotFoundError as error:
        raise Damaged(name, "missing") from error
    if found["size"] != expected["size"]:
        raise Damaged(name, f"{found['size']} bytes where its commit recorded {expected['size']}")
    if expected.get(ALGORITHM) is not None and found[ALGORITHM] != expected[ALGORITHM]:
        raise Damaged(
            name,
            f"CRC32C {found[ALGORITHM]} where its commit recorded {expected[ALGORITHM]} "
            f"(same size, {found['size']} bytes)",
        )
    if strong and not hmac.compare_digest(found[STRONG], str(expected[STRONG])):
        raise Tampered(
            name,
            f"SHA-256 {found[STRONG]} where its signed record says {expected[STRONG]} (same "
            f"size and CRC32C: a file made to match the CRC32C); refused as tampered",
        )


def aside(directory: str, name: str) -> str:
    """Where the damaged entry `name` of `directory` is kept: `damaged/<name>-<time>`, a
    name no engine lists or rotates (the time keeps a later damage of the same step apart)."""
    return files.join(directory, DAMAGED, f"{name}-{time.strftime('%Y%m%dT%H%M%S')}")
