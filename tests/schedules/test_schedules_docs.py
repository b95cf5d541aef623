"""The examples in docs/schedules.md and in the docstrings run, and print what they say."""

import contextlib
import io
import pathlib
import re

import pytest

from tests.helpers import run_docstring_examples

# Backend-generic: the torch run takes these too (tests/conftest.py).
pytestmark = pytest.mark.torch

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "schedules.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
MODULES = [
    "keras_accel.schedules",
    "keras_accel.schedules.base",
    "keras_accel.schedules.decay",
    "keras_accel.schedules.functional",
    "keras_accel.schedules.join",
    "keras_accel.schedules.piecewise",
    "keras_accel.schedules.validation",
    "keras_accel.schedules.warmup",
]


def test_the_doc_has_examples():
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_doc_block_runs(index):
    block = BLOCKS[index]
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block, f"{DOC.name}[block {index}]", "exec"), {"__name__": "__doc__"})
    # A print's output is stated in a comment after it, on its line or the next one.
    printed = output.getvalue().splitlines()
    lines = block.splitlines()
    prints = [i for i, line in enumerate(lines) if line.lstrip().startswith("print(")]
    assert len(printed) == len(prints), printed
    for out, i in zip(printed, prints):
        if "  # " in lines[i]:
            claim = lines[i].split("  # ", 1)[1]
        elif i + 1 < len(lines) and lines[i + 1].startswith("# "):
            claim = lines[i + 1][2:]
        else:
            continue
        if claim.endswith(" ..."):
            assert out.startswith(claim[:-4]), (out, claim)
        else:
            assert out == claim, (out, claim)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    run_docstring_examples(name)
