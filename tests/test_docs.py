"""Every python block of the README and docs/ runs, and prints what the page says it prints.

A print's expected output is written in a comment on the next line (`# ...`); a claim ending
in " ..." is a prefix. A block whose first line is `# KERAS_BACKEND=jax` runs on JAX only; one
with an opening comment line `# N devices: ...` prints what N devices give, and is skipped when
the suite runs on fewer (KERAS_ACCEL_TEST_DEVICES).
Pages with their own doc test (docs/schedules.md) are skipped here.
"""

import contextlib
import io
import pathlib
import re

import keras
import pytest

from tests.conftest import NUM_DEVICES
from tests.helpers import run_docstring_examples

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
# keras_accel.utils.devices is not here: its one example (configure_virtual_cpu_devices) is a
# fenced block, not a doctest, since it must run before the backend touches a device.
DOCSTRING_MODULES = [
    "keras_accel",
    "keras_accel.adapter.accelerator",
    "keras_accel.adapter.strategies",
    "keras_accel.adapter.sharding",
    "keras_accel.adapter.layouts",
    "keras_accel.utils.checks",
    "keras_accel.data.cifar10",
    "keras_accel.data.text",
    "keras_accel.loop",
    "keras_accel.models.bert",
    "keras_accel.models.flops",
    "keras_accel.models.seed",
    "keras_accel.state.outputs",
    "keras_accel.state.whole",
]


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


def devices_needed(block: str) -> int:
    """The device count a block's opening comments say it needs (`# 8 devices: ...`), or 1."""
    for line in block.splitlines():
        if not line.startswith("#"):
            break
        said = re.match(r"# (\d+) devices\b", line)
        if said:
            return int(said.group(1))
    return 1


def test_blocks_that_need_devices_say_so():
    # docs/sharding.md's layouts are those of 8 devices; a reader on one learns it from the
    # block itself (issue 34), and the suite run on fewer devices skips them.
    sharding = [b for p, _, b in BLOCKS if p.name == "sharding.md"]
    assert [devices_needed(b) for b in sharding[:4]] == [8, 8, 8, 8]


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in BLOCKS])
def test_doc_block(page, index, block):
    # A block that opens with this comment shows a JAX-only feature (its page says what
    # TensorFlow does instead, and a test of the package checks that).
    if block.startswith("# KERAS_BACKEND=jax") and keras.backend.backend() != "jax":
        pytest.skip("a JAX-only example (its first line says so)")
    needed = devices_needed(block)
    if needed > NUM_DEVICES:
        pytest.skip(f"an example on {needed} devices (it says so); the suite has {NUM_DEVICES}")
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block, f"{page.name}[block {index}]", "exec"), {"__name__": "__doc__"})
    check_claims(block, output.getvalue().splitlines())


@pytest.mark.parametrize("name", DOCSTRING_MODULES)
def test_docstring_examples(name):
    run_docstring_examples(name)


def test_every_module_with_docstring_examples_is_checked():
    from tests.benchmark.test_docstrings import MODULES as BENCHMARK
    from tests.callbacks.test_docstrings import MODULES as CALLBACKS
    from tests.schedules.test_schedules_docs import MODULES as SCHEDULES

    listed = [getattr(m, "values", [m])[0] for m in DOCSTRING_MODULES]  # pytest.param's value
    checked = {*listed, *BENCHMARK, *CALLBACKS, *SCHEDULES}
    package = ROOT / "keras_accel"
    with_examples = set()
    for path in package.rglob("*.py"):
        if re.search(r"^\s*>>> ", path.read_text(), re.M):
            parts = path.relative_to(ROOT).with_suffix("").parts
            with_examples.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert len(with_examples) > 10, with_examples
    assert with_examples <= checked, sorted(with_examples - checked)
