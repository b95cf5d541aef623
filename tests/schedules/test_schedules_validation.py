"""`validate_learning_rate` / `evaluate_learning_rate`: what a callback checks each step."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel.schedules import (
    CosineDecay,
    WarmupCosine,
    evaluate_learning_rate,
    validate_learning_rate,
)

# Backend-generic: the torch run takes these too (tests/conftest.py).
pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    "value",
    [0.1, 1, np.float32(0.1), np.float64(0.1), np.array(0.1), np.array([0.1]), 0.0],
    ids=["float", "int", "np_float32", "np_float64", "np_0d", "np_1_element", "zero"],
)
def test_numbers_pass_as_floats(value):
    out = validate_learning_rate(value, step=3)
    assert type(out) is float
    assert out == pytest.approx(float(np.asarray(value).reshape(())), rel=1e-6)


def test_backend_tensor_and_variable_pass():
    assert validate_learning_rate(ops.convert_to_tensor(0.25), step=0) == 0.25
    assert validate_learning_rate(keras.Variable(0.5), step=0) == 0.5


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (None, "not one number at step 7"),
        ("0.1", "value='0.1' (type str)"),
        (True, "value=True (type bool)"),
        ([0.1, 0.2], "value=[0.1, 0.2] (type list)"),
        (np.array([0.1, 0.2]), "shape (2,)"),
        (1 + 2j, "type complex"),
        ({"lr": 0.1}, "type dict"),
        (float("nan"), "returned nan at step 7"),
        (np.float32("inf"), "returned inf at step 7"),
        (-0.1, "negative learning rate at step 7"),
    ],
    ids=["none", "str", "bool", "list", "array", "complex", "dict", "nan", "inf", "negative"],
)
def test_bad_values_are_refused_with_the_step(value, fragment):
    with pytest.raises(ValueError, match="Received: value=") as info:
        validate_learning_rate(value, step=7)
    assert fragment in str(info.value)
    assert "step=7" in str(info.value)


def test_nan_tensor_is_refused():
    with pytest.raises(ValueError, match="returned nan at step 2"):
        validate_learning_rate(ops.convert_to_tensor(float("nan")), step=2)


def test_name_appears_in_the_message():
    with pytest.raises(ValueError, match="schedule my_schedule returned nan"):
        validate_learning_rate(float("nan"), step=0, name="my_schedule")


def test_evaluate_plain_function():
    assert evaluate_learning_rate(lambda step: 0.1 * 0.5**step, step=2) == pytest.approx(0.025)


def test_evaluate_keras_accel_schedule():
    schedule = WarmupCosine(1.0, warmup_steps=2, total_steps=6)
    assert evaluate_learning_rate(schedule, 1) == pytest.approx(0.5)


def test_evaluate_names_the_bad_schedule():
    def shrinking(step):
        return 0.1 / (3 - step) if step != 3 else float("nan")

    assert evaluate_learning_rate(shrinking, step=2) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="schedule shrinking returned nan at step 3"):
        evaluate_learning_rate(shrinking, step=3)
    with pytest.raises(ValueError, match=r"schedule CosineDecay\(init_value=1.0"):
        evaluate_learning_rate(_BrokenCosine(1.0, total_steps=4), step=0)


class _BrokenCosine(CosineDecay):
    """A keras_accel schedule whose value went wrong: its repr names it in the error."""

    def __call__(self, step):
        return float("nan")

    def __repr__(self):
        return "CosineDecay(init_value=1.0, broken=True)"


def test_evaluate_calls_once_and_lets_errors_through():
    calls = []

    def schedule(step):
        calls.append(step)
        raise TypeError("bug inside the user's schedule")

    with pytest.raises(TypeError, match="bug inside the user's schedule"):
        evaluate_learning_rate(schedule, step=4)
    assert calls == [4]  # no retry with other arguments


def test_evaluate_unbound_schedule_says_total_steps():
    with pytest.raises(ValueError, match="with_total_steps"):
        evaluate_learning_rate(CosineDecay(1.0), step=0)
