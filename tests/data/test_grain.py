"""Grain missing: the error says what to install (issue 34), not a bare ModuleNotFoundError."""

import importlib.util

import pytest

from keras_accel.data import grain


def test_without_grain_the_error_names_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "grain" else find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match=r'pip install "keras-accel\[grain\]"') as raised:
        grain.import_grain()
    assert raised.value.name == "grain"
