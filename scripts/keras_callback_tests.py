"""Run Keras's own callback tests against keras_accel's callbacks, and print a pass/fail table.

keras_accel's `LearningRateScheduler`, `ModelCheckpoint`, `BackupAndRestore` and `History`
are meant as drop-ins for Keras's classes of the same names. This script takes Keras's test
files for those classes, replaces Keras's classes by ours for the duration of the run, runs
each file with pytest (one subprocess per file, so no global state leaks between files), and
prints one row per file. A failing test listed in DOCUMENTED (a difference kept on purpose,
explained in docs/callbacks.md) is reported as such; any other failure makes the exit code 1.

Nothing is downloaded. The test files are read from `--keras-tests DIR`; by default from the
installed Keras package itself (its wheel ships `keras/src/callbacks/*_test.py`, the tests
of exactly the installed version). To use the files of a Keras tag instead, for each file:

    git -C keras show v3.15.1:keras/src/callbacks/NAME_test.py > DIR/NAME_test.py

Usage:

    KERAS_BACKEND=jax python scripts/keras_callback_tests.py --keras-tests DIR
    KERAS_BACKEND=tensorflow python scripts/keras_callback_tests.py --keras-tests DIR -v
    python scripts/keras_callback_tests.py --keras-classes   # Keras's own classes: baseline
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The classes replaced, and the Keras test file of each (Keras 3.15.1 has no history_test.py:
# a missing file is reported as absent, not as a failure).
CLASSES = ("BackupAndRestore", "History", "LearningRateScheduler", "ModelCheckpoint")
FILES = (
    "learning_rate_scheduler_test.py",
    "model_checkpoint_test.py",
    "backup_and_restore_test.py",
    "history_test.py",
)

# Keras tests that fail against keras_accel's classes on purpose, with the reason; the same
# table is in docs/callbacks.md ("Differences from Keras, on purpose"). Keys are
# "file::Class::test" node ids, as pytest prints them.
DOCUMENTED: dict[str, str] = {
    "learning_rate_scheduler_test.py::LearningRateSchedulerTest::"
    "test_throws_when_optimizer_has_schedule": (
        "an optimizer built with a LearningRateSchedule works: its schedule is replaced by a "
        "rate variable that the callback sets, where Keras raises a TypeError"
    ),
    "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_step": (
        "exact mid-epoch resume: each batch the interrupted run finished counts once (the "
        "CanaryLayer ends at 15 = 5 epochs x 3 batches); Keras restores the weights saved "
        "after the first epoch's second batch and trains that epoch from its first batch, so "
        "those two batches count twice (17)"
    ),
}


def default_tests_dir() -> Path | None:
    """Keras's own test files, as installed with Keras (no import of Keras here)."""
    spec = importlib.util.find_spec("keras")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "src" / "callbacks"


# --------------------------------------------------------------------------- child process
class _Plugin:
    """Swaps Keras's classes for keras_accel's during one pytest run, and records outcomes."""

    def __init__(self, replace: bool):
        self.replace = replace
        self.results: dict[str, dict] = {}
        self.constructed = 0
        self._undo: list[tuple[object, str, object]] = []

    def _set(self, owner, name, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def pytest_configure(self, config):
        # The markers Keras's own conftest.py registers; every backend here is trainable.
        config.addinivalue_line("markers", "requires_trainable_backend: trainable backend")
        config.addinivalue_line("markers", "multi_device: needs several devices")
        if not self.replace:
            return
        import keras
        import keras.src.callbacks

        import keras_accel.callbacks as ours

        self.originals = {name: getattr(keras.callbacks, name) for name in CLASSES}
        self.ours = {name: getattr(ours, name) for name in CLASSES}
        # The public API and the package the test files import (`from keras.src import
        # callbacks`). The defining modules (keras.src.callbacks.history, ...) stay: Keras's
        # own fit still adds its History to every run, as it would for a user.
        for module in (keras.callbacks, keras.src.callbacks):
            for name in CLASSES:
                self._set(module, name, self.ours[name])
        # Count constructions, so the table shows that ours really ran.
        for cls in self.ours.values():
            original_init = cls.__init__

            def counting_init(instance, *args, _init=original_init, _cls=cls, **kwargs):
                if type(instance) is _cls:
                    self.constructed += 1
                _init(instance, *args, **kwargs)

            self._set(cls, "__init__", counting_init)

    def pytest_collection_modifyitems(self, session, config, items):
        if not self.replace:
            return
        # `from keras.src.callbacks import ModelCheckpoint` in a test module binds the class
        # at import: replace such module-level names too.
        swap = {id(self.originals[name]): self.ours[name] for name in CLASSES}
        for module in {item.module for item in items if getattr(item, "module", None)}:
            for attribute, value in list(vars(module).items()):
                if id(value) in swap:
                    self._set(module, attribute, swap[id(value)])

    def pytest_runtest_logreport(self, report):
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _last_line(report.longreprtext)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def pytest_unconfigure(self, config):
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def _run_one(path: str, out: str, replace: bool, extra: list[str]) -> int:
    import pytest

    plugin = _Plugin(replace)
    # Our own config file (pyproject's testpaths, markers) must not apply to Keras's files.
    rc = pytest.main(
        [
            path,
            "-c",
            os.devnull,
            "--rootdir",
            str(Path(path).parent),
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::DeprecationWarning",
            *extra,
        ],
        plugins=[plugin],
    )
    Path(out).write_text(json.dumps({"results": plugin.results, "constructed": plugin.constructed}))
    return int(rc)


# --------------------------------------------------------------------------- parent process
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keras-tests",
        type=Path,
        default=None,
        help="folder holding Keras's *_test.py files (default: the installed "
        "Keras's keras/src/callbacks)",
    )
    parser.add_argument(
        "--files",
        nargs="*",
        default=list(FILES),
        help=f"test files to run (default: {' '.join(FILES)})",
    )
    parser.add_argument(
        "--keras-classes",
        action="store_true",
        help="run against Keras's own classes (a baseline), not keras_accel's",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show pytest's output, and every failing test"
    )
    parser.add_argument(
        "--pytest-args", default="", help='extra pytest arguments, one string (e.g. "-k verbose")'
    )
    parser.add_argument("--_one", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    extra = shlex.split(args.pytest_args)
    if args._one:
        return _run_one(args._one, args._out, not args.keras_classes, extra)

    folder = args.keras_tests or default_tests_dir()
    if folder is None or not folder.is_dir():
        parser.error(
            f"no folder of Keras test files: --keras-tests {folder} does not exist. Point it "
            "at a folder holding Keras's learning_rate_scheduler_test.py, "
            "model_checkpoint_test.py and backup_and_restore_test.py (e.g. from "
            "`git show v3.15.1:keras/src/callbacks/<file>` of keras-team/keras)."
        )
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # keras_accel importable from a checkout without an install, wherever this is run from.
    root = str(Path(os.path.abspath(__file__)).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    backend = env.get("KERAS_BACKEND", "(keras.json default)")
    against = "Keras's own classes" if args.keras_classes else "keras_accel.callbacks"
    print(f"Keras tests from {folder}, KERAS_BACKEND={backend}, against {against}")

    rows, unexpected, expected, stale = [], [], [], []
    for name in args.files:
        path = folder / name
        if not path.is_file():
            rows.append((name, "absent", "", "", "", ""))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.json")
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--_one",
                str(path),
                "--_out",
                out,
                "--pytest-args",
                args.pytest_args,
            ]
            if args.keras_classes:
                command.append("--keras-classes")
            start = time.perf_counter()
            child = subprocess.run(
                command, env=env, cwd=tmp, capture_output=not args.verbose, text=True
            )
            seconds = time.perf_counter() - start
            if not os.path.exists(out):
                tail = (child.stdout or "")[-2000:] + (child.stderr or "")[-2000:]
                rows.append((name, "crashed", "", "", "", f"{seconds:.0f}s"))
                unexpected.append((name, f"pytest exited {child.returncode}: {tail}"))
                continue
            record = json.loads(Path(out).read_text())
        results = record["results"]
        counts = {
            k: sum(r["outcome"] == k for r in results.values())
            for k in ("passed", "failed", "error", "skipped")
        }
        documented = 0
        for nodeid, result in results.items():
            key = _node_key(nodeid)
            if result["outcome"] not in ("failed", "error"):
                if not args.keras_classes and key in DOCUMENTED and result["outcome"] == "passed":
                    stale.append(key)
                continue
            if not args.keras_classes and key in DOCUMENTED:
                documented += 1
                expected.append((key, result["message"]))
            else:
                unexpected.append((nodeid, result["message"]))
        ran = counts["passed"] + counts["failed"] + counts["error"]
        rows.append(
            (
                name,
                f"{counts['passed']}/{ran}",
                str(counts["failed"] + counts["error"]),
                str(documented),
                str(counts["skipped"]),
                f"{seconds:.0f}s, {record['constructed']} ours built"
                if not args.keras_classes
                else f"{seconds:.0f}s",
            )
        )

    header = ("file", "passed/total", "failed", "of which documented", "skipped", "notes")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
    if unexpected:
        print("\nUnexpected failures:")
        for nodeid, message in unexpected:
            print(f"  {nodeid}\n      {message}")
    if expected:
        print("\nFailures that are documented differences (docs/callbacks.md):")
        for key, message in expected:
            print(f"  {key}\n      {message}\n      why: {DOCUMENTED[key]}")
    if stale:
        print("\nDocumented as differences, but passed (remove them from DOCUMENTED and docs):")
        for key in stale:
            print(f"  {key}")
    return 1 if unexpected else 0


def _node_key(nodeid: str) -> str:
    """'path/to/file.py::Class::test' -> 'file.py::Class::test'."""
    first, _, rest = nodeid.partition("::")
    return f"{os.path.basename(first)}::{rest}"


if __name__ == "__main__":
    sys.exit(main())
