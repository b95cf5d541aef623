"""The examples in the docstrings of keras_accel.callbacks and keras_accel.state.files run.

(The python blocks of docs/callbacks.md are run by tests/test_docs.py.)
"""

import pytest

from keras_accel.state import files
from tests.helpers import run_docstring_examples

MODULES = [
    "keras_accel.adapter.protocol",  # RunContext, exported as keras_accel.callbacks.RunContext
    "keras_accel.callbacks",  # the classes as exported by the package (`__all__`)
    "keras_accel.callbacks.backup",
    "keras_accel.callbacks.checkpoint",
    "keras_accel.callbacks.history",
    "keras_accel.callbacks.learning_rate",
    "keras_accel.state.files",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    try:
        run_docstring_examples(name)
    finally:
        if files.exists("memory://doc"):
            files.rmtree("memory://doc")
