"""The examples in the benchmark modules' docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "keras_accel.benchmark",
    "keras_accel.benchmark.peaks",
    "keras_accel.benchmark.spec",
    "keras_accel.benchmark.isolate",
    "keras_accel.benchmark.results",
    "keras_accel.benchmark.finder",
    "keras_accel.benchmark.sweep",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
