"""Run Keras's own trainer tests through one keras_accel Accelerator, against plain Keras.

Keras's `keras/src/trainers/trainer_test.py` is Keras's own statement of what `fit`, `evaluate`
and `predict` do: input kinds, metrics, callbacks, custom steps, `steps_per_execution`. This
script runs it twice per file, each run one pytest subprocess (no state leaks between runs):

- **plain**: Keras as it is (the baseline);
- **accelerator**: one `keras_accel.Accelerator()` over `--devices N` virtual CPU devices
  (default 8; 1 on torch, where one process is one device) for the whole run; every test runs
  inside `acc.scope()` (so its models are built and compiled there; for a unittest TestCase,
  from the end of Keras's own `TestCase.setUp` on), and `fit`, `evaluate` and `predict` of
  every model call `acc.fit(model, ...)`, `acc.evaluate(model, ...)` and
  `acc.predict(model, ...)`. That replacement is test
  tooling, in the child process only: the methods of the Keras trainer class that
  `keras.Model` inherits them from are replaced for the run. A call made while one of these is
  running (validation inside `fit`, a callback's `predict`) is Keras's own, as it is for a
  user of `acc.fit`. Keras's tests also define models that mix that trainer class with a layer
  directly (`class ExampleModel(Trainer, layers.Dense)`), which are not `keras.Model`s, and
  the Accelerator takes a `keras.Model`: in this run such classes are made `keras.Model`
  subclasses as they are defined (`keras.Model` is that trainer class and `Layer`);
  `--as-is` leaves them, and the Accelerator then refuses them.

Both runs configure the same N virtual devices; only the routing (and those classes) differ.
Per test the result is: passes both ways; fails only through the Accelerator (a regression:
the exit code is 1 unless the test is in DOCUMENTED, with the reason); fails under plain Keras
too (not ours); passes only through the Accelerator. A test that never called `fit`,
`evaluate` or `predict` (compile, `compute_loss`, symbolic builds) does not exercise the
Accelerator: the table counts those apart ("not routed"). The failures are then grouped by the
first line of their exception (numbers written as N), one example test each.

Which files: `trainer_test.py` alone. Of the data-adapter tests
(`trainers/data_adapters/*_test.py`) only one calls `fit`, `evaluate` or `predict`:
`tf_dataset_adapter_test.py`'s `test_distributed_datasets_from_function_model_integration`
(a data set distributed by the test's own MirroredStrategy). That module imports `torch` at
the top, which keras_accel's environments do not install, so it is not collected here; where
torch is installed, add it with `--files trainer_test.py data_adapters/tf_dataset_adapter_test.py
::TestTFDatasetAdapter::test_distributed_datasets_from_function_model_integration` (one
argument). Every other data-adapter test calls the adapter classes directly, so it cannot tell
the Accelerator from Keras; the input kinds they cover (NumPy, tf.data, generators, PyDataset,
sparse and ragged tensors) are trained in `trainer_test.py` too. `epoch_iterator_test.py` and
`compile_utils_test.py` never train either.

Nothing is downloaded. The test files are read from `--keras-tests DIR`, by default the
installed Keras's `keras/src/trainers` (its wheel ships the tests of exactly the installed
version). Another copy: `git -C keras show v3.15.1:keras/src/trainers/trainer_test.py`.

Usage:

    KERAS_BACKEND=jax python scripts/keras_trainer_tests.py                 # both runs, 8 devices
    KERAS_BACKEND=jax python scripts/keras_trainer_tests.py -k "sparse or ragged"
    KERAS_BACKEND=tensorflow python scripts/keras_trainer_tests.py --devices 2 -v
    python scripts/keras_trainer_tests.py --plain                           # the baseline only
    python scripts/keras_trainer_tests.py --save-json r.json                # keep both runs
    python scripts/keras_trainer_tests.py --baseline-json r.json            # reuse its plain run
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path

import pytest

# Paths under keras/src/trainers (a pytest node id, "file::Class::test", runs part of one).
FILES = ("trainer_test.py",)

# Keras tests that fail through the Accelerator on purpose: the backends where they do, and
# why (listed in docs/development.md, "Keras's trainer tests through the Accelerator"). Keys
# are "file::Class::test" node ids, as pytest prints them (with a parametrized test's suffix).
_SPARSE = (
    "sparse inputs are densified (docs/accelerator.md): the first Dense layer's gradient is "
    "dense, where Keras's TensorFlow trainer gives IndexedSlices, which this test checks"
)
_RAGGED = (
    "a tf.RaggedTensor is refused with what to do (docs/accelerator.md): every batch is "
    "padded to one static shape, and padding a ragged row would change what the model computes"
)
_ON_BATCH = (
    "Keras's own train_on_batch/test_on_batch/predict_on_batch are not Accelerator calls "
    "(docs/accelerator.md, 'Keras's *_on_batch methods'): on a model built in acc.scope() "
    "they run raw distribution (JAX: IndivisibleError for a batch that does not split over "
    "the devices; TensorFlow: every replica runs the whole batch)"
)
DOCUMENTED: dict[str, tuple[tuple[str, ...], str]] = {
    **{
        f"trainer_test.py::TestTrainer::test_on_batch_methods_{name}": (
            ("jax", "tensorflow") if name == "jit" else ("jax",),
            _ON_BATCH,
        )
        for name in ("eager", "graph_fn", "jit")
    },
    **{
        f"trainer_test.py::TestTrainer::test_on_batch_methods_without_training_{name}": (
            ("jax", "tensorflow") if name == "jit" else ("jax",),
            _ON_BATCH,
        )
        for name in ("eager", "graph_fn", "jit")
    },
    "trainer_test.py::TestTrainer::test_nested_inputs": (("jax", "tensorflow"), _ON_BATCH),
    "trainer_test.py::TestTrainer::test_retracing": (
        ("jax", "tensorflow"),
        "a model overriding train_step gets (x, y) batches, which cannot weight padding rows "
        "out: batch_size=1 over 8 replicas is refused with what works (docs/accelerator.md, "
        "'Custom steps: the data contract')",
    ),
    "trainer_test.py::TestTrainer::test_loss_scaling_prevents_underflow": (
        ("jax", "tensorflow"),
        "its model mixes Keras's trainer class with a layer and sets `self.layers`; made a "
        "keras.Model (the Accelerator takes only those), it cannot be built: keras.Model "
        'reserves `layers` ("`Model.layers` attribute is reserved")',
    ),
    **{
        f"trainer_test.py::TestTrainer::test_fit_sparse_{kind}_{mode}": (("tensorflow",), _SPARSE)
        for kind in ("jax", "scipy", "tf")
        for mode in ("eager", "graph")
    },
    **{
        f"trainer_test.py::TestTrainer::test_trainer_with_raggeds_{kind}": (
            ("tensorflow",),
            _RAGGED,
        )
        for kind in ("functional", "layer", "model")
    },
    # Keras's callback tests (`--files ../callbacks/callback_test.py ...`, docs/development.md).
    "callback_test.py::CallbackTest::test_model_state_is_current_on_epoch_end": (
        ("tensorflow",),
        "its callback calls `int()` on a model variable, a MirroredVariable under "
        "tf.distribute, which TensorFlow refuses in a replica context: plain Keras under "
        "`tf.distribute.MirroredStrategy` fails alike",
    ),
    "reduce_lr_on_plateau_test.py::ReduceLROnPlateauTest::test_cooldown": (
        ("tensorflow",),
        "it converts the learning rate, a MirroredVariable, to NumPy inside the strategy's "
        "scope (the routed test body runs in `acc.scope()`), which TensorFlow refuses ('object "
        "__array__ method not producing an array'): plain Keras in a MirroredStrategy's scope "
        "fails alike; outside it, it passes",
    ),
    "swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute": (
        ("tensorflow",),
        "the test makes its own MirroredStrategy inside the Accelerator's scope: TensorFlow "
        "refuses two strategies ('Mixing different tf.distribute.Strategy objects')",
    ),
}


def documented(key: str, backend: str | None) -> str | None:
    """Why `key` fails through the Accelerator on `backend` on purpose, or None."""
    backends, why = DOCUMENTED.get(key, ((), ""))
    return why if backend in backends else None


ROUTED = ("fit", "evaluate", "predict")
_ABSENT = object()
FAILED = ("failed", "error", "crashed")
MAX_RESTARTS = 10  # pytest runs started again after a crash, per file and run


def default_tests_dir() -> Path | None:
    """Keras's own trainer tests, as installed with Keras (no import of Keras here)."""
    spec = importlib.util.find_spec("keras")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "src" / "trainers"


# --------------------------------------------------------------------------- child process
class _Plugin:
    """Routes every model's fit/evaluate/predict through one Accelerator during one pytest
    run (`accelerator=False`: plain Keras), and writes each test's outcome as it ends."""

    def __init__(self, accelerator: bool, out: str, rebase: bool):
        self.accelerator = accelerator
        self.rebase = rebase
        self.out = open(out, "a", buffering=1)  # noqa: SIM115 - one line per test, flushed.
        self.acc = None
        self.depth = 0  # Routed calls running now: a call inside one is Keras's own.
        self.current: str | None = None
        self.routed: dict[str, int] = {}
        self.backend: str | None = None
        self.results: dict[str, dict] = {}
        self._undo: list[tuple[object, str, object]] = []

    def pytest_configure(self, config):
        # The markers Keras's own conftest.py registers; every backend here is trainable.
        config.addinivalue_line("markers", "requires_trainable_backend: trainable backend")
        config.addinivalue_line("markers", "multi_device: needs several devices")
        import keras

        self.backend = keras.backend.backend()

        # The backend's trainer class (JAXTrainer, TensorFlowTrainer): keras.Model's methods
        # come from it, and Keras's tests also mix it with a layer directly (ExampleModel).
        if not self.accelerator:
            return
        import keras_accel

        trainer = next(c for c in keras.Model.__mro__ if "fit" in vars(c))
        if self.rebase:
            self._rebase_mixes(trainer, keras.Model)
        self.acc = keras_accel.Accelerator()
        for name in ROUTED:
            self._set(trainer, name, self._route(name, vars(trainer)[name]))

    def _set(self, owner, name, value) -> None:
        self._undo.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def _rebase_mixes(self, trainer, model_class) -> None:
        """`class ExampleModel(Trainer, layers.Dense)` becomes `(layers.Dense, keras.Model)`
        as Python makes it: the Accelerator takes a `keras.Model` (Keras's one public trainer
        class), and `keras.Model` is that trainer and `Layer` (its `__init__` calls just
        theirs). Classes made inside a test function too, hence `__init_subclass__`."""
        out = self.out

        def init_subclass(cls, **kwargs):
            super(trainer, cls).__init_subclass__(**kwargs)
            if trainer in cls.__bases__ and not issubclass(cls, model_class):
                others = tuple(b for b in cls.__bases__ if b is not trainer)
                # After a layer class of its own (Dense's methods first, as before); before
                # `Layer` itself, which keras.Model already derives from.
                if any(issubclass(model_class, b) for b in others):
                    cls.__bases__ = (model_class, *others)
                else:
                    cls.__bases__ = (*others, model_class)
                out.write(json.dumps({"rebased": cls.__qualname__}) + "\n")

        self._set(trainer, "__init_subclass__", classmethod(init_subclass))

    def _route(self, name, keras_method):
        @functools.wraps(keras_method)
        def routed(model, *args, **kwargs):
            if self.depth:
                return keras_method(model, *args, **kwargs)
            self.depth += 1
            if self.current is not None:
                self.routed[self.current] = self.routed.get(self.current, 0) + 1
            try:
                return getattr(self.acc, name)(model, *args, **kwargs)
            finally:
                self.depth -= 1

        return routed

    def pytest_runtest_logstart(self, nodeid, location):
        self.current = nodeid
        self.out.write(json.dumps({"started": nodeid}) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        """Each test inside `acc.scope()`, so that the models it builds are built there."""
        if self.acc is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            instance = getattr(item, "instance", None)
            if isinstance(instance, unittest.TestCase):
                # A unittest TestCase's setUp runs in pytest's call phase, and Keras's clears
                # the session: on JAX the global distribution that the scope set, on
                # TensorFlow the graph whose strategy stack the scope would leave. So the
                # scope is entered right after Keras's own `TestCase.setUp` (a subclass's
                # setUp that builds and compiles a model after `super().setUp()` does so
                # in it), or after the whole setUp where that is never called.
                from keras.src import testing

                entered = []

                def enter() -> None:
                    if not entered:
                        entered.append(True)
                        stack.enter_context(self.acc.scope())

                keras_set_up = testing.TestCase.setUp

                def keras_set_up_then_scope(this):
                    keras_set_up(this)
                    if this is instance:
                        enter()

                testing.TestCase.setUp = keras_set_up_then_scope
                stack.callback(setattr, testing.TestCase, "setUp", keras_set_up)
                set_up = instance.setUp

                def set_up_in_scope():
                    set_up()
                    enter()

                instance.setUp = set_up_in_scope
            else:
                stack.enter_context(self.acc.scope())
            yield

    def pytest_collectreport(self, report):
        # A file that does not import (a module it needs is not installed) fails both runs.
        if report.failed:
            entry = {"outcome": "error", "message": _first_line(report), "routed": 0}
            self.out.write(json.dumps({"nodeid": report.nodeid, **entry}) + "\n")

    def pytest_runtest_logreport(self, report):
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if report.failed and entry["outcome"] not in FAILED:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _first_line(report)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["message"] = _skip_reason(report)
        if report.when == "teardown":
            entry["routed"] = self.routed.get(report.nodeid, 0)
            entry["seconds"] = round(report.duration + getattr(self, "_call_seconds", 0.0), 2)
            record = {"nodeid": report.nodeid, **entry, "backend": self.backend}
            self.out.write(json.dumps(record) + "\n")
            self.current = None
        elif report.when == "call":
            self._call_seconds = report.duration

    def pytest_unconfigure(self, config):
        for owner, name, value in reversed(self._undo):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self._undo.clear()
        self.out.close()


def _first_line(report) -> str:
    """The first line of the exception a test failed with ("ValueError: ..."). Where that
    line only announces the rest ("AssertionError:" before assert_allclose's report,
    TensorFlow's "Graph execution error:" or "in user code:"), the line that says what went
    wrong is added: the last exception line inside, else the first line after it (the last,
    after TensorFlow's stack, for a graph execution error)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", None) or ""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        texts = [line.strip() for line in report.longreprtext.splitlines() if line.strip()]
        errors = [line[1:].strip() for line in texts if line.startswith("E ")]
        return (errors[0] if errors else texts[-1] if texts else "")[:1000]
    first, rest = lines[0], [x for x in lines[1:] if not x.startswith(("File ", "[[", "•"))]
    if first.endswith(":") and rest:
        errors = [x for x in rest if re.match(r"[\w.]+(Error|Exception)\b[^:]*:", x)]
        if errors:
            first = f"{first} {errors[-1]}"
        else:
            first = f"{first} {rest[-1] if 'Graph execution error' in first else rest[0]}"
    return first[:1000]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")[:200]
    return ""


def _run_one(
    target: str, out: str, accelerator: bool, devices: int, extra: list[str], rebase: bool
) -> int:
    # The devices first: before anything (a test module's import included) touches one.
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(devices)

    plugin = _Plugin(accelerator, out, rebase)
    path = target.partition("::")[0]
    # Our own config file (pyproject's testpaths, markers) must not apply to Keras's files.
    return int(
        pytest.main(
            [
                target,
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
    )


# --------------------------------------------------------------------------- parent process
def _read_results(out: str) -> tuple[dict[str, dict], str | None, set[str]]:
    """Each finished test's record, the test that was running when the child ended (a
    crash or a hang's timeout) if one was, and the classes made keras.Model subclasses."""
    results, started, rebased = {}, None, set()
    if not os.path.exists(out):
        return results, None, rebased
    for line in Path(out).read_text().splitlines():
        record = json.loads(line)
        if "rebased" in record:
            rebased.add(record["rebased"])
        elif "started" in record:
            started = record["started"]
        else:
            nodeid = record.pop("nodeid")
            results[nodeid] = record
            if nodeid == started:
                started = None
    return results, started, rebased


def _run_child(script, target, mode, args, env) -> tuple[dict[str, dict], float, str, set]:
    """One pytest subprocess over `target` (another after each crash, without the tests run
    so far): its per-test records, seconds, a note (why it ended early), and the classes it
    made keras.Model subclasses."""
    extra = shlex.split(args.pytest_args)
    if args.k:
        extra += ["-k", args.k]
    if args.test_timeout:
        # A hung test ends its run (every thread's stack printed), and counts as crashed.
        extra += [
            "-o",
            f"faulthandler_timeout={args.test_timeout}",
            "-o",
            "faulthandler_exit_on_timeout=true",
        ]
    results: dict[str, dict] = {}
    rebased: set[str] = set()
    seconds, note = 0.0, ""
    for _ in range(MAX_RESTARTS + 1):
        # Node ids as the child reports them (relative to the test file's folder, its
        # rootdir): a test already run, or the one that crashed its run, is not run again.
        done = [arg for nodeid in results for arg in ("--deselect", nodeid)]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.jsonl")
            command = [
                sys.executable,
                script,
                "--_one",
                target,
                "--_out",
                out,
                "--_mode",
                mode,
                "--devices",
                str(args.devices),
                # One `=` argument: a string that starts with "-" is not an option of ours.
                f"--pytest-args={shlex.join(extra + done)}",
            ]
            if args.as_is:
                command.append("--as-is")
            start = time.perf_counter()
            child = subprocess.run(
                command, env=env, cwd=tmp, capture_output=not args.verbose, text=True
            )
            seconds += time.perf_counter() - start
            found, running, made = _read_results(out)
        results.update(found)
        rebased |= made
        if running is None:
            # Exit 1 is pytest's "some tests failed", which records them; with no record,
            # the child failed before any test (an error of ours in its setup).
            if child.returncode not in (0, 5) and not found:
                tail = ((child.stdout or "") + (child.stderr or ""))[-3000:]
                note = f"pytest exited {child.returncode}: {tail}"
            break
        results[running] = {
            "outcome": "crashed",
            "message": _crash_message(child),
            "routed": 0,
        }
    else:
        note = f"stopped after {MAX_RESTARTS} crashed runs; the tests not yet run are missing"
    return results, seconds, note, rebased


def _crash_message(child) -> str:
    """Why a pytest process ended during a test: the fatal line of its output if captured
    (an abort's check failure, a hang's timeout), else its exit status."""
    text = (child.stdout or "") + "\n" + (child.stderr or "")
    fatal = re.search(
        r"(Fatal Python error|Check failed|terminate called|Timeout \().*", text, re.S
    )
    # Its first line, which says what (an abort, a check of XLA's, a hang's timeout), and
    # the next where the first only announces it; not the threads' stacks after them.
    lines = [line.strip() for line in fatal.group(0).splitlines() if line.strip()] if fatal else []
    said = lines[:2] if lines and lines[0].endswith(":") else lines[:1]
    why = ": " + " ".join(said)[:200] if said else ""
    return f"the pytest process ended during this test (exit {child.returncode}){why}"


_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(\.\d+)?(e[-+]?\d+)?")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def failure_kind(message: str) -> str:
    """A failure's kind: its exception's first line with addresses and numbers as N, so that
    `batch_size=4` and `batch_size=2` read as one kind (cut at 240 characters)."""
    kind = _NUMBER.sub("N", _ADDRESS.sub("0x…", message)).strip() or "(no message)"
    return kind if len(kind) <= 240 else kind[:239] + "…"


def _node_key(nodeid: str) -> str:
    """'path/to/file.py::Class::test' -> 'file.py::Class::test'."""
    first, _, rest = nodeid.partition("::")
    return f"{os.path.basename(first)}::{rest}"


def _table(header, rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |"
        for row in [header, tuple("-" * w for w in widths), *rows]
    ]


def _print_kinds(title: str, failures: list[tuple[str, dict]]) -> None:
    """Failures grouped by kind, most frequent first, one example test each."""
    if not failures:
        return
    kinds: dict[str, list[tuple[str, dict]]] = {}
    for nodeid, result in failures:
        kinds.setdefault(failure_kind(result["message"]), []).append((nodeid, result))
    print(f"\n{title} ({len(failures)} tests, {len(kinds)} kinds):")
    for kind, members in sorted(kinds.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        nodeid, result = members[0]
        print(f"  [{len(members)}] {kind}")
        print(f"      e.g. {_node_key(nodeid)}")
        if failure_kind(result["message"]) != result["message"]:
            print(f"           {result['message'][:240]}")


def classify(plain: dict | None, accel: dict | None) -> str:
    """One test's row: both | accelerator-only failure | both fail | plain-only failure."""
    plain_failed = plain is not None and plain["outcome"] in FAILED
    accel_failed = accel is not None and accel["outcome"] in FAILED
    if plain is None or accel is None:
        return "one run only"
    if plain["outcome"] == "skipped" or accel["outcome"] == "skipped":
        return "skipped"
    if plain_failed and accel_failed:
        return "fail both"
    if accel_failed:
        return "fail accelerator only"
    if plain_failed:
        return "fail plain only"
    return "pass both"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keras-tests",
        type=Path,
        default=None,
        help="folder holding Keras's trainer tests, as keras/src/trainers does (default: the "
        "installed Keras's)",
    )
    parser.add_argument(
        "--files",
        nargs="*",
        default=list(FILES),
        help="test files (or pytest node ids) under that folder (default: " + " ".join(FILES) + ")",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="virtual CPU devices in both runs; the Accelerator uses all (default 8; 1 on "
        "torch, where one process is one device)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--plain", action="store_true", help="run plain Keras only (the baseline), no comparison"
    )
    mode.add_argument(
        "--baseline-json",
        type=Path,
        help="take the plain runs from this --save-json file instead of running them again",
    )
    parser.add_argument("-k", help="pytest's -k: select tests by name expression")
    parser.add_argument(
        "--as-is",
        action="store_true",
        help="leave the tests' models that mix Keras's trainer class with a layer as they are "
        "(the Accelerator refuses them: it takes a keras.Model); by default the Accelerator's "
        "run makes such classes keras.Model subclasses",
    )
    parser.add_argument(
        "--save-json", type=Path, help="write every test's outcome in both runs to this file"
    )
    parser.add_argument(
        "--test-timeout",
        type=int,
        default=1200,
        help="seconds one test may run before its pytest run is ended (0: none; default 1200)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show pytest's output, and every test that fails only through the Accelerator",
    )
    parser.add_argument(
        "--pytest-args", default="", help='extra pytest arguments, one string (e.g. "-x")'
    )
    parser.add_argument("--_one", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    parser.add_argument("--_mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.devices is None:
        args.devices = 1 if os.environ.get("KERAS_BACKEND") == "torch" else 8
    if args.devices < 1:
        parser.error(f"--devices must be a positive number of devices. Received: {args.devices}")
    if args._one:
        return _run_one(
            args._one,
            args._out,
            args._mode == "accelerator",
            args.devices,
            shlex.split(args.pytest_args),
            not args.as_is,
        )

    folder = args.keras_tests or default_tests_dir()
    if folder is None or not folder.is_dir():
        parser.error(
            f"no folder of Keras test files: --keras-tests {folder} does not exist. Point it "
            "at a folder laid out as keras/src/trainers (holding trainer_test.py), e.g. from "
            "`git show v3.15.1:keras/src/trainers/trainer_test.py` of keras-team/keras."
        )
    baseline = {}
    if args.baseline_json:
        baseline = json.loads(args.baseline_json.read_text())["plain"]
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # keras_accel importable from a checkout without an install, wherever this is run from.
    root = str(Path(os.path.abspath(__file__)).parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    backend = env.get("KERAS_BACKEND", "(keras.json default)")
    print(
        f"Keras tests from {folder}, KERAS_BACKEND={backend}, {args.devices} virtual CPU "
        f"devices, {'plain Keras only' if args.plain else 'plain Keras and the Accelerator'}"
        + (f" (plain Keras's results from {args.baseline_json})" if baseline else "")
        + (f", -k {args.k!r}" if args.k else ""),
        flush=True,
    )

    script = os.path.abspath(__file__)
    runs: dict[str, dict[str, dict]] = {"plain": {}, "accelerator": {}}
    rows, crashes, rebased = [], [], set()
    for target in args.files:
        path = folder / target.partition("::")[0]
        if not path.is_file():
            rows.append((target.partition("::")[0], "absent", *[""] * 8))
            continue
        full = str(folder / target)
        times = []
        for mode in ("plain", "accelerator"):
            if mode == "plain" and baseline:
                continue  # Taken below, for the tests this run selected.
            if mode == "accelerator" and args.plain:
                continue
            results, seconds, note, made = _run_child(script, full, mode, args, env)
            rebased |= made
            if note:
                crashes.append((f"{target} ({mode})", note))
            runs[mode].update({_node_key(k): v for k, v in results.items()})
            times.append(f"{mode} {seconds:.0f}s")
            print(f"  {target.partition('::')[0]}: {mode} run done in {seconds:.0f}s", flush=True)
        if baseline:
            selected = [k for k in runs["accelerator"] if _in(k, target)]
            runs["plain"].update({k: baseline[k] for k in selected if k in baseline})
        keys = sorted(k for run in runs.values() for k in run if _in(k, target))
        keys = list(dict.fromkeys(keys))
        plain, accel = runs["plain"], runs["accelerator"]
        counts = {}
        for key in keys:
            row = "plain only" if args.plain else classify(plain.get(key), accel.get(key))
            counts[row] = counts.get(row, 0) + 1
        ran_plain = [plain[k] for k in keys if k in plain and plain[k]["outcome"] != "skipped"]
        ran_accel = [accel[k] for k in keys if k in accel and accel[k]["outcome"] != "skipped"]
        rows.append(
            (
                target.partition("::")[0],
                f"{sum(r['outcome'] == 'passed' for r in ran_plain)}/{len(ran_plain)}",
                ""
                if args.plain
                else f"{sum(r['outcome'] == 'passed' for r in ran_accel)}/{len(ran_accel)}",
                str(counts.get("pass both", "")),
                _with_documented(counts.get("fail accelerator only", 0), keys, accel),
                str(counts.get("fail both", "")),
                str(counts.get("fail plain only", "")),
                str(sum(plain[k]["outcome"] == "skipped" for k in keys if k in plain) or ""),
                str(sum(1 for k in keys if k in accel and not accel[k].get("routed")) or "")
                if not args.plain
                else "",
                ", ".join(times),
            )
        )

    header = (
        "file",
        "plain passed",
        "accelerator passed",
        "pass both",
        "fail accelerator only",
        "fail both",
        "fail plain only",
        "skipped",
        "not routed",
        "time",
    )
    print()
    for line in _table(header, rows):
        print(line)

    plain, accel = runs["plain"], runs["accelerator"]
    regressions, expected, both, plain_only = [], [], [], []
    backend = _backend_of(accel)
    stale = [
        k
        for k in DOCUMENTED
        if documented(k, backend) and accel.get(k, {}).get("outcome") == "passed"
    ]
    for key in sorted(set(plain) | set(accel)):
        row = classify(plain.get(key), accel.get(key))
        if row == "fail accelerator only":
            why = documented(key, backend)
            (expected if why else regressions).append((key, accel[key]))
        elif row == "fail both":
            both.append((key, accel[key]))
        elif row == "fail plain only":
            plain_only.append((key, plain[key]))
    if args.plain:
        _print_kinds(
            "Failures under plain Keras",
            [(k, v) for k, v in sorted(plain.items()) if v["outcome"] in FAILED],
        )
    else:
        _print_kinds("Fail only through the Accelerator, by kind", regressions)
        _print_kinds("Fail under plain Keras too (not ours), by kind", both)
        _print_kinds("Fail under plain Keras only", plain_only)
        if expected:
            print("\nFailures that are documented differences (docs/development.md):")
            for key, result in expected:
                why = documented(key, backend)
                print(f"  {key}\n      {result['message'][:240]}\n      why: {why}")
        if stale:
            print("\nDocumented as differences, but passed (remove them from DOCUMENTED and docs):")
            for key in stale:
                print(f"  {key}")
        if args.verbose and regressions:
            print("\nEvery test failing only through the Accelerator:")
            for key, result in regressions:
                print(f"  {key}\n      {result['message']}")
    if rebased:
        print(
            "\nMade keras.Model subclasses for the Accelerator (they mixed Keras's trainer class "
            f"with a layer; --as-is leaves them): {', '.join(sorted(rebased))}"
        )
    for where, note in crashes:
        print(f"\n{where}: {note}")
    if args.save_json:
        args.save_json.write_text(json.dumps(runs, indent=1, sort_keys=True))
    return 1 if regressions or crashes else 0


def _with_documented(count: int, keys: list[str], accel: dict) -> str:
    """'67 (1 documented)': failures only through the Accelerator, and those in DOCUMENTED."""
    backend = _backend_of(accel)
    known = sum(
        1 for k in keys if documented(k, backend) and accel.get(k, {}).get("outcome") in FAILED
    )
    if not count:
        return ""
    return f"{count} ({known} documented)" if known else str(count)


def _backend_of(run: dict[str, dict]) -> str | None:
    """The backend a run's tests ran on, as each test's record says."""
    return next((r["backend"] for r in run.values() if r.get("backend")), None)


def _in(key: str, target: str) -> bool:
    """Whether the test `key` ("file.py::Class::test") was run for `target`."""
    path, _, node = target.partition("::")
    return key.startswith(f"{os.path.basename(path)}::{node}")


if __name__ == "__main__":
    sys.exit(main())
