"""Every python block of the README and docs/ runs, and prints what the page says it prints.

A print's expected output is written in a comment on the next line (`# ...`); a claim ending
in " ..." is a prefix. Pages with their own doc test (docs/schedules.md) are skipped here.
"""

import contextlib
import doctest
import importlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OWN_TESTS = {"schedules.md"}
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").glob("*.md") if p.name not in OWN_TESTS
)
BLOCKS = [
    (page, index, block)
    for page in PAGES
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]
DOCSTRING_MODULES = ["keras_accel", "keras_accel.adapter.accelerator", "keras_accel.utils.devices"]


def check_claims(block: str, printed: list[str]) -> None:
    lines = block.splitlines()
    prints = [i for i, line in enumerate(lines) if line.lstrip().startswith("print(")]
    claims = {}
    for i in prints:
        if i + 1 < len(lines) and lines[i + 1].startswith("# "):
            claims[len(claims)] = lines[i + 1][2:]
        else:
            claims[len(claims)] = None
    if not any(claims.values()):
        return
    assert len(printed) >= len(prints), printed
    # Keras may print progress lines; claims are matched against the last printed lines.
    tail = printed[len(printed) - len(prints) :]
    for out, claim in zip(tail, claims.values()):
        if claim is None:
            continue
        if claim.endswith(" ..."):
            assert out.startswith(claim[:-4]), (out, claim)
        else:
            assert out == claim, (out, claim)


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in BLOCKS])
def test_doc_block(page, index, block):
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block, f"{page.name}[block {index}]", "exec"), {"__name__": "__doc__"})
    check_claims(block, output.getvalue().splitlines())


@pytest.mark.parametrize("name", DOCSTRING_MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
