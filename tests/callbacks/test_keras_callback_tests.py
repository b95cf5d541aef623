"""scripts/keras_callback_tests.py: Keras's classes really are replaced by ours, and the table
and exit status say what failed."""

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "keras_callback_tests.py"

# A stand-in for a Keras test file: imports as Keras's tests do, plus one failing test.
FAKE_TEST = """
import keras
from keras.src import callbacks
from keras.src.callbacks import History

import keras_accel.callbacks as ours


def test_names_are_ours():
    assert callbacks.ModelCheckpoint is ours.ModelCheckpoint
    assert keras.callbacks.BackupAndRestore is ours.BackupAndRestore
    assert History is ours.History  # Imported by name, at collection.
    callbacks.LearningRateScheduler(lambda epoch: 0.1)


def test_fails():
    assert 1 == 2
"""


def test_replaces_keras_classes_and_reports_failures(tmp_path):
    (tmp_path / "fake_test.py").write_text(FAKE_TEST)
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--keras-tests",
            str(tmp_path),
            "--files",
            "fake_test.py",
            "missing_test.py",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr[-2000:]
    row = next(line for line in out.splitlines() if line.startswith("| fake_test.py"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:5] == ["1/2", "1", "0", "0"] and "1 ours built" in cells[5]
    assert any(
        line.startswith("| missing_test.py") and "absent" in line for line in out.splitlines()
    )
    assert "Unexpected failures:" in out and "fake_test.py::test_fails" in out
    assert "assert 1 == 2" in out
