"""The examples in the benchmark modules' docstrings run and print what they say."""

import pytest

from tests.helpers import run_docstring_examples

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
    run_docstring_examples(name)
