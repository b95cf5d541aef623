"""A restore runs no code from the backup (issue 62).

Someone who can write a shared backup folder plants a newer step whose metadata is a pickle
that runs a command (`os.system`, `builtins.eval`, `subprocess.Popen`,
`importlib.import_module`), and re-seals the step's checksum record as anyone with write
access can. The resumed run must run none of it (a marker file the payload would create is
the witness), set the step aside as damaged, and resume from the step before, ending as the
run that met no plant. torch's DCP would `pickle.load` its `.metadata`; Orbax's and
tf.train's metadata is JSON and protobufs, where the same bytes are a damaged file.

One small model, three epochs of 4 steps, a backup each epoch (steps 4, 8, 12), as
test_faults.py.
"""

import builtins
import importlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_accel.callbacks import BackupAndRestore
from keras_accel.state import checksums, files

# The fault matrix's model and run (its data: 4 steps an epoch).
from tests.callbacks.test_faults import fit, model

pytestmark = pytest.mark.torch  # Every backend's engine: Orbax, tf.train, DCP.

PAYLOADS = ("os.system", "builtins.eval", "subprocess.Popen", "importlib.import_module")
MODULE = "keras_accel_planted_payload"  # What the import_module payload imports.


class _Call:
    """Pickles as a call of `function(*args)`: what a planted pickle runs when loaded."""

    def __init__(self, function, *args):
        self.call = (function, args)

    def __reduce__(self):
        return self.call


def payload(kind: str, marker: str, folder) -> bytes:
    """A pickle that creates `marker` when unpickled, through `kind`."""
    touch = f"open({marker!r}, 'w').close()"
    if kind == "os.system":
        call = _Call(os.system, f"touch {marker}")
    elif kind == "builtins.eval":
        call = _Call(builtins.eval, touch)
    elif kind == "subprocess.Popen":
        call = _Call(subprocess.Popen, ["touch", marker])
    else:  # A module the attacker placed where Python finds it.
        (folder / f"{MODULE}.py").write_text(touch + "\n")
        call = _Call(importlib.import_module, MODULE)
    # Inside what looks like an index, as a planted `.metadata` would be.
    return pickle.dumps({"state_dict_metadata": call, "version": "1.0.0"})


def metadata_files(step_path: str) -> list[str]:
    """The files of a step that its engine reads as metadata: DCP's `.metadata`, Orbax's
    `_CHECKPOINT_METADATA` and `_METADATA` files, tf.train's `.index`."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return [f"{step_path}.index"]
    names = (".metadata",) if backend == "torch" else ("_CHECKPOINT_METADATA", "_METADATA")
    return [
        os.path.join(root, name)
        for root, _, found in os.walk(step_path)
        for name in found
        if name in names
    ]


def reseal(step_path: str) -> None:
    """Rewrite the step's checksum record for its files as they are now, as anyone who can
    write the folder can (a CRC32C is no signature)."""
    if not os.path.isdir(step_path):
        return  # tf.train keeps no record of ours: it checks its own.
    recorded = checksums.read(step_path)
    if recorded is not None:
        files.write_atomic(
            files.join(step_path, checksums.RECORD),
            json.dumps(checksums.record(step_path, sorted(recorded["files"]))),
        )


@pytest.fixture(scope="module")
def uninterrupted():
    weights = fit(model())
    keras.backend.clear_session()
    return weights


def test_a_planted_pickle_runs_nothing_is_set_aside_and_the_step_before_restored(
    tmp_path, monkeypatch, uninterrupted
):
    monkeypatch.syspath_prepend(str(tmp_path))
    backup_dir = str(tmp_path / "backup")
    first = BackupAndRestore(backup_dir, delete_checkpoint=False)
    fit(model(), first, epochs=2)  # A run that ended after 2 of 3 epochs: steps 4 and 8.
    newest = first.checkpoints()[-1]
    assert re.search(r"\b(ckpt-|dcp-)?8$", newest), newest
    pristine = str(tmp_path / "pristine")
    shutil.copytree(backup_dir, pristine)
    marker = str(tmp_path / "ran")
    # Orbax and tf.train unpickle nothing: one payload shows their parsers' refusal; on torch
    # each payload is one global the allow-list must refuse.
    for kind in PAYLOADS if keras.backend.backend() == "torch" else PAYLOADS[:1]:
        shutil.rmtree(backup_dir)
        shutil.copytree(pristine, backup_dir)
        planted = metadata_files(newest)
        assert planted, os.listdir(newest if os.path.isdir(newest) else backup_dir)
        for path in planted:
            with open(path, "wb") as f:
                f.write(payload(kind, marker, tmp_path))
        reseal(newest)

        with pytest.warns(UserWarning) as caught:
            resumed = fit(model(), BackupAndRestore(backup_dir))
        assert not os.path.exists(marker), f"the {kind} payload ran"
        (warning,) = [str(w.message) for w in caught if "is damaged" in str(w.message)]
        assert warning.startswith(
            f"BackupAndRestore: the backup of step 8 in {backup_dir!r} is damaged: "
        ), warning
        assert warning.endswith("Resuming from step 4, the newest intact backup."), warning
        backend = keras.backend.backend()
        if backend == "torch":  # Refused by the allow-list, naming what it asked for.
            global_name = {
                "os.system": f"{os.system.__module__}.system",
                "builtins.eval": "builtins.eval",
                "subprocess.Popen": "subprocess.Popen",
                "importlib.import_module": "importlib.import_module",
            }[kind]
            assert f".metadata: its pickle loads the global {global_name}, " in warning
        elif backend == "jax":  # Orbax reads its metadata as JSON.
            assert ": not the JSON Orbax writes there (UnicodeDecodeError: " in warning
        else:  # tf.train reads its index as a table.
            assert "ckpt-8.index: not an sstable (bad magic number)" in warning
        aside = re.search(r"It is kept as '([^']*)'", warning).group(1)
        assert os.path.dirname(aside) == os.path.join(backup_dir, checksums.DAMAGED)
        for a, b in zip(resumed, uninterrupted, strict=True):
            np.testing.assert_array_equal(a, b)
    assert MODULE not in sys.modules
