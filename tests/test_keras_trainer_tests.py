"""scripts/keras_trainer_tests.py: every model's fit/evaluate/predict really goes through the
Accelerator, inside its scope, and the table, the failure kinds and the exit status say what
failed where. One pytest subprocess: the plain Keras run is a baseline file written here."""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "keras_trainer_tests.py"

# A stand-in for Keras's trainer_test.py. The Accelerator's methods are mocked: what is tested
# is the routing, not training (keras_accel's own tests do that).
FAKE_TEST = """
from unittest import mock

import keras
import numpy as np
import pytest

import keras_accel

TRAINER = next(c for c in keras.Model.__mro__ if "fit" in vars(c))


class Mixed(TRAINER, keras.layers.Dense):  # As Keras's ExampleModel: not a keras.Model.
    def __init__(self):
        keras.layers.Dense.__init__(self, units=1)
        TRAINER.__init__(self)


def in_scope():
    if keras.backend.backend() == "jax":
        return keras.distribution.distribution() is not None
    import tensorflow as tf

    return tf.distribute.has_strategy()


def test_routed_in_scope():
    assert in_scope()
    assert isinstance(Mixed(), keras.Model)
    with mock.patch.object(keras_accel.Accelerator, "predict", return_value="routed"):
        assert Mixed().predict(np.zeros((2, 1))) == "routed"


@pytest.mark.parametrize("rows", [3, 5])
def test_refused(rows):
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    with mock.patch.object(
        keras_accel.Accelerator, "fit", side_effect=RuntimeError(f"refused {rows} rows")
    ):
        model.fit(np.zeros((rows, 1)), np.zeros((rows, 1)), verbose=0)


def test_broken():
    raise ValueError("broken")


def test_left_out_by_k():
    raise AssertionError("-k did not select")
"""

# What plain Keras gives for those tests (its run is not repeated here).
BASELINE = {
    "trainer_test.py::test_routed_in_scope": {"outcome": "failed", "message": "AssertionError"},
    "trainer_test.py::test_refused[3]": {"outcome": "passed", "message": ""},
    "trainer_test.py::test_refused[5]": {"outcome": "passed", "message": ""},
    "trainer_test.py::test_broken": {"outcome": "failed", "message": "ValueError: broken"},
}


def test_routes_through_the_accelerator_and_groups_failures(tmp_path):
    (tmp_path / "trainer_test.py").write_text(FAKE_TEST)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"plain": BASELINE, "accelerator": {}}))
    saved = tmp_path / "saved.json"
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--keras-tests",
            str(tmp_path),
            "--files",
            "trainer_test.py",
            "missing_test.py",
            "--devices",
            "2",
            "--baseline-json",
            str(baseline),
            "--save-json",
            str(saved),
            "-k",
            "not left_out",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr[-3000:]
    row = next(line for line in out.splitlines() if line.startswith("| trainer_test.py"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    # plain passed, accelerator passed, pass both, fail accelerator only, fail both,
    # fail plain only, skipped, not routed.
    assert cells[1:9] == ["2/4", "1/4", "", "2", "1", "1", "", "1"], row
    assert any(
        line.startswith("| missing_test.py") and "absent" in line for line in out.splitlines()
    )
    only_ours = out.split("Fail only through the Accelerator, by kind (2 tests, 1 kinds):")[1]
    assert only_ours.splitlines()[1].strip() == "[2] RuntimeError: refused N rows"
    assert "e.g. trainer_test.py::test_refused[3]" in only_ours
    assert "not ours), by kind (1 tests, 1 kinds):\n  [1] ValueError: broken" in out
    assert "test_left_out_by_k" not in out
    assert "keras.Model subclasses for the Accelerator" in out and ": Mixed" in out
    accelerator = json.loads(saved.read_text())["accelerator"]
    assert accelerator["trainer_test.py::test_routed_in_scope"]["routed"] == 1
    assert accelerator["trainer_test.py::test_broken"]["routed"] == 0
