"""Every Keras (and TensorFlow) internal keras_accel touches goes through
`keras_accel/utils/keras_internals.py`, where it is checked once and a missing one fails
naming the Keras version.

The package's source is read (AST) and every reach into another object's private member is
listed: `obj._name` where `obj` is anything but `self` or `cls`, and a private name passed as
a string where a call names an attribute (`getattr`/`setattr`/`hasattr`/`delattr(obj,
"_name")`, `keras_internals.require(obj, "_name")`, `patches.set(obj, "_name", value)`).
Dunders (`__class__`) are not private. Outside keras_internals.py each one must be:

- a module's own name: a private member of a class defined in the same module (a method, a
  class attribute, or an attribute it assigns on `self`/`cls`). A module is the unit of
  privacy: schedules/base.py sets `_total_steps` on a copy of itself; keras_accel's classes
  in *other* modules talk through public names. A name keras_internals.py reads is never
  "own" (a class of ours with a `_learning_rate` of its own cannot hide a read of Keras's);
- or in `ALLOWED`, by file and name, with the reason.

An `ALLOWED` entry that matches nothing fails too, so the list cannot rot.
"""

import ast
import pathlib
import textwrap

import keras_accel

PACKAGE = pathlib.Path(keras_accel.__file__).parent
ROOT = PACKAGE.parent
INTERNALS = PACKAGE / "utils" / "keras_internals.py"

# (file, name): why. Short, one reason each.
ALLOWED = {
    ("keras_accel/callbacks/_lock.py", "_in_fit"): (
        "BackupAndRestore's own question (is its fit running?), asked by the directory lock "
        "that BackupAndRestore owns (one of ours, in another module)"
    ),
    ("keras_accel/callbacks/backup.py", "_current_frames"): (
        "stdlib: sys._current_frames is documented API, the only view of other threads' "
        "stacks (is an interrupted fit still running anywhere?)"
    ),
    ("keras_accel/callbacks/backup.py", "_register_atexit"): (
        "stdlib: CPython's hook that runs before threading's pools shut down (Python >= 3.9; "
        "atexit where absent, which is too late for Orbax's writer threads)"
    ),
    ("keras_accel/utils/cluster.py", "_exit"): "stdlib: os._exit is public, documented API",
    ("keras_accel/adapter/backends/torch.py", "_version"): (
        "torch: Tensor._version, the in-place version counter autograd itself checks; the "
        "only way to see that a gradient changed after the backward pass sent it"
    ),
    ("keras_accel/state/engines/torch_dcp.py", "_save_state_dict"): (
        "torch: DCP's saver without its one-process warning, looked up with getattr and "
        "falling back to the public dcp.save where a torch release lacks it"
    ),
}

_NAMING_CALLS = {"getattr", "setattr", "hasattr", "delattr", "require", "set"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def accesses(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, private name, the object's source) for each reach into another object."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value):
            found.append((node.lineno, node.attr, ast.unparse(node.value)))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            obj, name = node.args[0], node.args[1]
            if (
                called in _NAMING_CALLS
                and isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and _private(name.value)
                and not _is_self(obj)
            ):
                found.append((node.lineno, name.value, f"{called}({ast.unparse(obj)}, ...)"))
    return found


def own_names(tree: ast.AST) -> set[str]:
    """The private members of the module's own classes: defined in a class body, or
    assigned on `self`/`cls`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else []
                if isinstance(item, (ast.AnnAssign, ast.AugAssign)):
                    targets = [item.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and _is_self(part.value):
                    names.add(part.attr)
    return {name for name in names if _private(name)}


def keras_names() -> set[str]:
    """The private names keras_internals.py reads: Keras's, never a module's own."""
    tree = ast.parse(INTERNALS.read_text())
    names = {name for _, name, _ in accesses(tree)}
    names |= {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _private(node.value)
    }
    return names


def violations(path: pathlib.Path, source: str, keras: set[str]) -> list[tuple[int, str, str]]:
    tree = ast.parse(source, str(path))
    own = own_names(tree) - keras
    return [access for access in accesses(tree) if access[1] not in own]


def _found() -> dict[tuple[str, str], list[str]]:
    """(file, name) -> the places, for every access outside keras_internals.py."""
    keras = keras_names()
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == INTERNALS:
            continue
        relative = path.relative_to(ROOT).as_posix()
        for line, name, obj in violations(path, path.read_text(), keras):
            found.setdefault((relative, name), []).append(f"{relative}:{line}: {name} ({obj})")
    return found


def test_every_internal_goes_through_keras_internals():
    unlisted = [
        place for key, places in sorted(_found().items()) if key not in ALLOWED for place in places
    ]
    assert not unlisted, (
        "Private members of objects other than self/cls, outside "
        "keras_accel/utils/keras_internals.py: read a Keras internal through an accessor "
        "there (checked, failing with the Keras version), make our own name public, or add "
        "(file, name) to ALLOWED with the reason:\n  " + "\n  ".join(unlisted)
    )


def test_every_allowed_entry_still_matches():
    stale = sorted(set(ALLOWED) - set(_found()))
    assert not stale, f"ALLOWED entries that match no access any more (remove them): {stale}"


def test_every_allowed_entry_says_why():
    assert all(len(reason) > 10 for reason in ALLOWED.values())


def _walk(source: str) -> list[tuple[str, str]]:
    tree = textwrap.dedent(source)
    return [(name, obj) for _, name, obj in violations(pathlib.Path("x.py"), tree, {"_keras"})]


def test_the_walk_finds_every_form_of_access():
    found = _walk(
        """
        model._compile_loss
        getattr(model, "_compile_metrics", None)
        hasattr(layer, "_inbound_nodes")
        setattr(model, "_initial_epoch", 0)
        keras_internals.require(optimizer, "_learning_rate", "why")
        patches.set(layer, "_moments", moments)
        self.loop._backend
        """
    )
    assert [name for name, _ in found] == [
        "_compile_loss",
        "_compile_metrics",
        "_inbound_nodes",
        "_initial_epoch",
        "_learning_rate",
        "_moments",
        "_backend",
    ]


def test_the_walk_leaves_self_dunders_and_own_names():
    found = _walk(
        """
        class Schedule:
            _table = {}

            def __init__(self):
                self._total = 1
                self._keras = 2

            def _resolve(self):
                cls = type(self)
                copy = cls()
                copy._total, copy._resolve, Schedule._table
                getattr(self, "_anything"), self._anything, cls._anything
                model.__class__
                other._keras
        """
    )
    # `_keras` is assigned on self here, but keras_internals reads it: never "own".
    assert found == [("_keras", "other")]


def test_a_new_violation_is_reported_with_file_and_line():
    """Shown on a copy of a real module with one access added."""
    module = PACKAGE / "callbacks" / "history.py"
    source = module.read_text() + "\n\ndef _peek(model):\n    return model._loss_tracker\n"
    line = source.count("\n")
    found = violations(module, source, keras_names())
    assert (line, "_loss_tracker", "model") in found
