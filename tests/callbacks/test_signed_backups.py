"""Signed backups (issue 62): with a signing key, a step whose checksum record does not
verify under the key is refused as tampered, set aside, and the step before it restored.

An attacker who can write the backup folder but has no key can change a file and re-seal
its CRC32C record (keeping the old signature, or none), copy an older step over a newer
one, or remove the record: each is refused. The wrong key refuses every step. Without a
key, records are what they were, and a signed backup restores as any other.

One small model, two epochs of 4 steps written (steps 4 and 8), resumed for a third, as
test_untrusted_backups.py; the resumed run must end as the run that met no tampering.
"""

import glob
import json
import os
import re
import shutil
import warnings

import keras
import numpy as np
import pytest

from keras_accel.callbacks import BackupAndRestore
from keras_accel.state import checksums, files
from tests.callbacks.test_untrusted_backups import fit, model

pytestmark = pytest.mark.torch  # Every backend's engine: Orbax, tf.train, DCP.

KEY = b"keras-accel-test-signing-key-0123"


def record_path(step_path: str) -> str:
    """Where a step's record is: in its directory (Orbax, DCP), or beside tf.train's files."""
    if os.path.isdir(step_path):
        return os.path.join(step_path, checksums.RECORD)
    return f"{step_path}.{checksums.RECORD}"


def read_record(step_path: str) -> dict:
    with open(record_path(step_path)) as f:
        return json.load(f)


def step_files(step_path: str) -> list[str]:
    if os.path.isdir(step_path):
        return [os.path.join(r, n) for r, _, names in os.walk(step_path) for n in names]
    return glob.glob(f"{step_path}.*")


@pytest.fixture(scope="module")
def signed(tmp_path_factory):
    """(a signed backup directory of steps 4 and 8, their paths, the 3-epoch run's weights)."""
    root = tmp_path_factory.mktemp("signed")
    backup_dir = str(root / "backup")
    first = BackupAndRestore(backup_dir, delete_checkpoint=False, signing_key=KEY.decode())
    fit(model(), first, epochs=2)
    steps = first.checkpoints()
    assert [re.search(r"(\d+)$", s).group(1) for s in steps] == ["4", "8"], steps
    uninterrupted = fit(model())
    keras.backend.clear_session()
    return backup_dir, steps, uninterrupted


def copy(signed, tmp_path):
    """A copy of the signed backup: (its directory, the paths of steps 4 and 8 there)."""
    source, steps, _ = signed
    backup_dir = str(tmp_path / "backup")
    shutil.copytree(source, backup_dir)
    return backup_dir, [s.replace(source, backup_dir) for s in steps]


def resume(backup_dir, expected, **kwargs):
    """Resume the 3-epoch run; its weights must be the uninterrupted run's. Returns the
    warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weights = fit(model(), BackupAndRestore(backup_dir, **kwargs))
    for a, b in zip(weights, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    return [str(w.message) for w in caught]


def refused(messages, backup_dir, why):
    """The one warning that step 8 was refused as tampered for `why`, step 4 restored."""
    (warning,) = [m for m in messages if "refused as tampered" in m]
    assert warning.startswith(
        f"BackupAndRestore: the backup of step 8 in {backup_dir!r} is refused as tampered: "
    ), warning
    assert why in warning, warning
    assert warning.endswith("Resuming from step 4, the newest intact backup."), warning
    aside = re.search(r"It is kept as '([^']*)'", warning).group(1)
    assert os.path.dirname(aside) == os.path.join(backup_dir, checksums.DAMAGED)


def test_a_signed_backup_restores_and_holds_no_key(signed, tmp_path, monkeypatch):
    backup_dir, steps = copy(signed, tmp_path)
    for step in steps:
        recorded = read_record(step)
        assert re.fullmatch(r"[0-9a-f]{64}", recorded[checksums.SIGNATURE]), recorded
    for path in glob.glob(os.path.join(backup_dir, "**"), recursive=True):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                assert KEY not in f.read(), path
    # The environment's key for launchers; the argument wins over it.
    monkeypatch.setenv(checksums.KEY_VARIABLE, "not the key")
    messages = resume(backup_dir, signed[2], signing_key=KEY, delete_checkpoint=False)
    assert not [m for m in messages if "tampered" in m or "damaged" in m], messages
    assert checksums.DAMAGED not in os.listdir(backup_dir)


def test_a_changed_file_under_a_resealed_record_is_refused(signed, tmp_path):
    backup_dir, (_, newest) = copy(signed, tmp_path)
    data = max(step_files(newest), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        chunk = f.read(16)
        f.seek(-len(chunk), 1)
        f.write(bytes(b ^ 0xFF for b in chunk))
    # The attacker re-seals the CRC32Cs and keeps the signature: no key, no new signature.
    old = read_record(newest)
    root = newest if os.path.isdir(newest) else os.path.dirname(newest)
    forged = checksums.record(root, sorted(old["files"]))
    forged[checksums.SIGNATURE] = old[checksums.SIGNATURE]
    files.write_atomic(record_path(newest), json.dumps(forged))
    messages = resume(backup_dir, signed[2], signing_key=KEY)
    refused(messages, backup_dir, "its HMAC-SHA256 does not verify for step 8 under the signing")


def _crc32c_patch(data: bytes, wanted: int) -> bytes:
    """4 bytes that, appended to `data`, make its CRC32C `wanted`: CRC32C is linear, which is
    why a signed record signs each file's SHA-256 too."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    by_top = {c >> 24: i for i, c in enumerate(table)}
    indices, register = [], wanted ^ 0xFFFFFFFF
    for _ in range(4):  # Backwards from the wanted register: which table entries it needs.
        index = by_top[register >> 24]
        indices.append(index)
        register = ((register ^ table[index]) << 8) & 0xFFFFFFFF
    register = int(checksums.digest_bytes(data), 16) ^ 0xFFFFFFFF
    patch = bytearray()
    for index in reversed(indices):  # Forwards: the bytes that pick those entries.
        patch.append((register ^ index) & 0xFF)
        register = (register >> 8) ^ table[index]
    return bytes(patch)


def test_a_changed_file_with_the_same_crc32c_under_a_genuine_record_is_refused(signed, tmp_path):
    backup_dir, (_, newest) = copy(signed, tmp_path)
    data = max(step_files(newest), key=os.path.getsize)
    with open(data, "rb") as f:
        original = f.read()
    changed = bytearray(original[:-4])
    half = len(changed) // 2
    changed[half : half + 16] = bytes(b ^ 0xFF for b in changed[half : half + 16])
    forged = bytes(changed) + _crc32c_patch(
        bytes(changed), int(checksums.digest_bytes(original), 16)
    )
    assert checksums.digest_bytes(forged) == checksums.digest_bytes(original)
    assert len(forged) == len(original) and forged != original
    with open(data, "wb") as f:
        f.write(forged)
    messages = resume(backup_dir, signed[2], signing_key=KEY)
    refused(messages, backup_dir, "(same size and CRC32C: a file made to match the CRC32C)")


def test_an_older_step_copied_over_a_newer_is_refused(signed, tmp_path):
    backup_dir, (older, newest) = copy(signed, tmp_path)
    if os.path.isdir(newest):
        shutil.rmtree(newest)
        shutil.copytree(older, newest)
    else:  # tf.train: ckpt-4.* as ckpt-8.*, its record too.
        for path in step_files(newest):
            os.remove(path)
        for path in step_files(older):
            shutil.copyfile(path, newest + path[len(older) :])
    messages = resume(backup_dir, signed[2], signing_key=KEY)
    refused(messages, backup_dir, "does not verify for step 8")


def test_a_step_without_a_record_is_refused_with_a_key(signed, tmp_path):
    backup_dir, (_, newest) = copy(signed, tmp_path)
    os.remove(record_path(newest))
    messages = resume(backup_dir, signed[2], signing_key=KEY)
    refused(messages, backup_dir, "missing, and a signing key is set")


def test_an_unsigned_record_is_refused_with_a_key(signed, tmp_path):
    backup_dir, (_, newest) = copy(signed, tmp_path)
    recorded = read_record(newest)
    del recorded[checksums.SIGNATURE]
    files.write_atomic(record_path(newest), json.dumps(recorded))
    messages = resume(backup_dir, signed[2], signing_key=KEY)
    refused(messages, backup_dir, "unsigned, and a signing key is set")


def test_the_wrong_key_refuses_every_step(signed, tmp_path):
    backup_dir, _ = copy(signed, tmp_path)
    with pytest.raises(RuntimeError, match="is intact") as caught:
        fit(model(), BackupAndRestore(backup_dir, signing_key=b"k3y-0f-s0me0ne-3lse"))
    for step in (4, 8):
        assert f"does not verify for step {step} under the signing key" in str(caught.value)
    assert "k3y-0f-s0me0ne-3lse" not in str(caught.value)


def test_without_a_key_records_are_unsigned_and_a_signed_backup_restores(
    signed, tmp_path, monkeypatch
):
    monkeypatch.delenv(checksums.KEY_VARIABLE, raising=False)
    backup_dir, _ = copy(signed, tmp_path)
    messages = resume(backup_dir, signed[2])  # The signature is not checked without a key.
    assert not [m for m in messages if "tampered" in m or "damaged" in m], messages
    plain = str(tmp_path / "plain")
    first = BackupAndRestore(plain, delete_checkpoint=False)
    fit(model(), first, epochs=1)
    (step,) = first.checkpoints()
    if keras.backend.backend() == "tensorflow":  # TensorFlow checks its own: no record.
        assert not os.path.exists(record_path(step))
    else:
        assert set(read_record(step)) == {"algorithm", "files"}


def test_the_key_in_the_environment_is_used_where_no_argument_is_given(
    signed, tmp_path, monkeypatch
):
    backup_dir, (_, newest) = copy(signed, tmp_path)
    os.remove(record_path(newest))
    monkeypatch.setenv(checksums.KEY_VARIABLE, KEY.decode())
    messages = resume(backup_dir, signed[2])
    refused(messages, backup_dir, "missing, and a signing key is set")
