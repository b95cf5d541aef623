"""Every private name keras_accel reaches into goes through its internals modules: the
`keras_accel/utils/keras_internals/` package (Keras's) and `keras_accel/utils/library_internals/`
(Python's, torch's, TensorFlow's own, JAX's, Grain's), where each is listed with its reason
and checked, a missing one failing with the library's version.

The package's source is read (AST) and every reach-through is listed:

- **an attribute**: `obj._name` where `obj` is anything but `self` or `cls`, and a private
  name passed as a string where a call names an attribute (`getattr`/`setattr`/`hasattr`/
  `delattr(obj, "_name")`, `keras_internals.require(obj, "_name")`, `patches.set(obj,
  "_name", value)`). Dunders (`__class__`) are not private. A module is the unit of privacy:
  a private member of a class defined in the same module (a method, a class attribute, or
  an attribute it assigns on `self`/`cls`) is the module's own (schedules/base.py sets
  `_total_steps` on a copy of itself), except on a name bound by an import (`sweep._paths`
  is another module's) and except a name the keras_internals package reads (a class of ours with a
  `_learning_rate` of its own cannot hide a read of Keras's);
- **an import of another module's private name**: `from keras_accel.x.y import _name`,
  unless the importer is inside the package that holds it (`schedules/base.py` imports
  `keras_accel.schedules._checks`; `callbacks/backup.py` imports `callbacks._lock`);
- **one of our own names given a private spelling** on import (`import_name as _name`):
  a name another module uses is public, and reads as such;
- **a private module of another library**: any import of a path with a private part
  (`jax._src`, `torch.distributed.checkpoint._fsspec_filesystem`) or under Keras's and
  TensorFlow's private trees (`keras.src`, `tensorflow.python`).

Outside the internals modules each must be in `ALLOWED`, by file and name, with the reason.
An `ALLOWED` entry that matches nothing fails too, so the list cannot rot; and there are at
most `BOUND` of them, so that it cannot grow back either.

Our own private names are held stricter still (`test_our_privates_stay_home`): the object,
not the module, is the unit of privacy, so that no two modules share a contract nothing names:

- **on another object**: `obj._name` where `obj` is not `self`/`cls`, even where `_name` is
  a member of a class of the same module (a copy of `self`, `type(self)`, another instance);
- **inherited across modules**: `self._name`/`cls._name` where `_name` is defined (in a class
  body, or assigned on `self`/`cls`) in another keras_accel module only, and by no base class
  of another library (a Keras callback's `self._model` is Keras's, read as Keras's subclasses
  read it).
"""

import ast
import functools
import importlib
import inspect
import pathlib
import textwrap

import pytest

import keras_accel

pytestmark = pytest.mark.torch  # Reads source only: every backend's run checks it.

PACKAGE = pathlib.Path(keras_accel.__file__).parent
ROOT = PACKAGE.parent
KERAS_INTERNALS = sorted((PACKAGE / "utils" / "keras_internals").glob("*.py"))
INTERNALS = {*KERAS_INTERNALS, *(PACKAGE / "utils" / "library_internals").glob("*.py")}

# At most this many reach-throughs outside the internals modules (issue 42: 21 had crept in).
BOUND = 10

# (file, name): why. Short, one reason each. For an import, the name is the private module's
# path or the private name imported.
ALLOWED: dict[tuple[str, str], str] = {}

_NAMING_CALLS = {"getattr", "setattr", "hasattr", "delattr", "require", "set"}
_PRIVATE_TREES = ("keras.src", "tensorflow.python")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _module_name(path: pathlib.Path) -> str:
    """`keras_accel.callbacks.backup` for keras_accel/callbacks/backup.py (a package's
    `keras_accel.callbacks.__init__`: its package is the one it opens)."""
    return ".".join(path.with_suffix("").parts)


def _imported_names(tree: ast.AST) -> set[str]:
    """The names the module binds by importing (modules, and names taken from them)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


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


def imports(tree: ast.AST, module: str) -> list[tuple[int, str, str]]:
    """(line, name, what) for each import that reaches into a private name: another of our
    modules' private name, one of our names given a private spelling, or another library's
    private module. `module` is the importer's dotted name."""
    package = module.rsplit(".", 1)[0] if module else ""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            paths = [(alias.name, alias.asname) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # Relative: from the importer's package up.
                parent = module.split(".")[: -node.level] if module else []
                base = ".".join([*parent, *([base] if base else [])])
            paths = [(f"{base}.{alias.name}", alias.asname) for alias in node.names]
        else:
            continue
        for path, asname in paths:
            parts = path.split(".")
            if parts[0] == "keras_accel":
                for index, part in enumerate(parts):
                    owner = ".".join(parts[:index])
                    inside = package == owner or package.startswith(owner + ".")
                    if _private(part) and not inside:
                        found.append((node.lineno, part, f"import {path}"))
                        break
                else:
                    if asname and _private(asname):
                        found.append((node.lineno, asname, f"import {path} as {asname}"))
                continue
            private = [i for i, part in enumerate(parts) if _private(part)]
            if private:
                # `from x._y import z`: the private module's path names it.
                where = ".".join(parts[: private[0] + 1])
                found.append((node.lineno, where, f"import {path}"))
            elif path.startswith(_PRIVATE_TREES):
                module_path = path if isinstance(node, ast.Import) else path.rsplit(".", 1)[0]
                found.append((node.lineno, module_path, f"import {path}"))
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
    """The private names the keras_internals package reads: Keras's, never a module's own."""
    names = set()
    for path in KERAS_INTERNALS:
        tree = ast.parse(path.read_text())
        names |= {name for _, name, _ in accesses(tree)}
        names |= {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _private(node.value)
        }
    return names


def violations(
    path: pathlib.Path, source: str, keras: set[str], module: str = ""
) -> list[tuple[int, str, str]]:
    tree = ast.parse(source, str(path))
    own = own_names(tree) - keras
    imported = _imported_names(tree)

    def of_another_module(obj: str) -> bool:
        return obj.split(".")[0].split("(")[-1] in imported

    found = [
        access for access in accesses(tree) if access[1] not in own or of_another_module(access[2])
    ]
    return found + imports(tree, module)


def _found() -> dict[tuple[str, str], list[str]]:
    """(file, name) -> the places, for every reach-through outside the internals modules."""
    keras = keras_names()
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in INTERNALS:
            continue
        relative = path.relative_to(ROOT)
        name = relative.as_posix()
        for line, private, obj in violations(path, path.read_text(), keras, _module_name(relative)):
            found.setdefault((name, private), []).append(f"{name}:{line}: {private} ({obj})")
    return found


def test_every_internal_goes_through_the_internals_modules():
    unlisted = [
        place for key, places in sorted(_found().items()) if key not in ALLOWED for place in places
    ]
    assert not unlisted, (
        "Private names reached outside keras_accel/utils/keras_internals/ and "
        "library_internals/: read a Keras internal through an accessor in keras_internals "
        "(another library's in library_internals), each checked and failing with the "
        "library's version; give our own name a public spelling; or, at most "
        f"{BOUND} in all, add (file, name) to ALLOWED with the reason:\n  " + "\n  ".join(unlisted)
    )


def test_at_most_the_bound_outside_the_internals_modules():
    found = sorted(_found())
    assert len(found) <= BOUND, (
        f"{len(found)} private reach-throughs outside the internals modules (at most {BOUND}): "
        f"{found}"
    )
    assert len(ALLOWED) <= BOUND


def test_every_allowed_entry_still_matches():
    stale = sorted(set(ALLOWED) - set(_found()))
    assert not stale, f"ALLOWED entries that match no access any more (remove them): {stale}"


def test_every_allowed_entry_says_why():
    assert all(len(reason) > 10 for reason in ALLOWED.values())


def _walk(source: str, module: str = "keras_accel.adapter.x") -> list[tuple[str, str]]:
    tree = textwrap.dedent(source)
    found = violations(pathlib.Path("x.py"), tree, {"_keras"}, module)
    return [(name, obj) for _, name, obj in found]


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


def test_the_walk_finds_private_names_of_other_modules():
    found = _walk(
        """
        import sys
        from keras_accel.benchmark import sweep
        from keras_accel.benchmark.sweep import _model_paths
        from keras_accel.callbacks._run import run_state
        from keras_accel.data.sources import refuse as _refuse
        from ..data import _private_helper
        from jax._src import distributed
        from tensorflow.python.data.ops import options
        import keras.src.trainers

        class Finder:
            def _paths(self):
                return sweep._paths(), sys._current_frames()
        """
    )
    assert found == [
        ("_paths", "sweep"),  # Though Finder has a `_paths` of its own.
        ("_current_frames", "sys"),
        ("_model_paths", "import keras_accel.benchmark.sweep._model_paths"),
        ("_run", "import keras_accel.callbacks._run.run_state"),
        ("_refuse", "import keras_accel.data.sources.refuse as _refuse"),
        ("_private_helper", "import keras_accel.data._private_helper"),
        ("jax._src", "import jax._src.distributed"),
        ("tensorflow.python.data.ops", "import tensorflow.python.data.ops.options"),
        ("keras.src.trainers", "import keras.src.trainers"),
    ]


def test_a_package_may_import_its_own_private_modules():
    source = """
        from keras_accel.schedules import _checks
        from keras_accel.schedules._checks import step_count
        from . import _checks
        from ._checks import step_count
        import csv as _csv
        """
    assert _walk(source, module="keras_accel.schedules.base") == []
    assert _walk(source, module="keras_accel.schedules.__init__") == []


def test_a_new_violation_is_reported_with_file_and_line():
    """Shown on a copy of a real module with one access added."""
    module = PACKAGE / "callbacks" / "history.py"
    source = module.read_text() + "\n\ndef _peek(model):\n    return model._loss_tracker\n"
    line = source.count("\n")
    found = violations(module, source, keras_names(), "keras_accel.callbacks.history")
    assert (line, "_loss_tracker", "model") in found


# ------------------------------------------------------------ our own privates kept home


def _self_reads(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, private name, the qualified name of the class it is read in) for each
    `self._name`/`cls._name` read, and each `getattr(self, "_name")`/`hasattr`, in a class
    body (the innermost class; a class made inside a function has no qualified name: "")."""
    found = []

    def visit(node: ast.AST, qualname: str | None, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if in_function:
                    inner = ""  # Made inside a function: no qualified name to load it by.
                else:
                    inner = child.name if qualname is None else f"{qualname}.{child.name}"
                visit(child, inner, False)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, qualname, True)
                continue
            if qualname is not None and isinstance(child, ast.Attribute):
                if (
                    _is_self(child.value)
                    and _private(child.attr)
                    and isinstance(child.ctx, ast.Load)
                ):
                    found.append((child.lineno, child.attr, qualname))
            elif qualname is not None and isinstance(child, ast.Call):
                called = getattr(child.func, "id", None)
                if (
                    called in ("getattr", "hasattr")
                    and len(child.args) >= 2
                    and _is_self(child.args[0])
                    and isinstance(child.args[1], ast.Constant)
                    and isinstance(child.args[1].value, str)
                    and _private(child.args[1].value)
                ):
                    found.append((child.lineno, child.args[1].value, qualname))
            visit(child, qualname, in_function)

    visit(tree, None, False)
    return found


@functools.cache
def _assigned_on_self(cls: type) -> frozenset[str]:
    """The names `cls`'s own source assigns on `self`/`cls` (its instance attributes); none
    where its source cannot be read (a class written in C)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _is_self(node.value)
        and isinstance(node.ctx, ast.Store)
    )


def _defined_by_a_library_base(cls: type | None, name: str) -> bool:
    """Whether a base class of `cls` from another library (Keras's `Callback`, a `Layer`)
    defines `name`: its own attribute, which our subclass reads as Keras's own do."""
    for base in cls.__mro__[1:] if cls is not None else ():
        if base.__module__.split(".")[0] == "keras_accel":
            continue
        if name in vars(base) or name in _assigned_on_self(base):
            return True
    return False


def _load_class(module: str, qualname: str) -> type | None:
    """The class `qualname` of the module `module`, or None where it cannot be had."""
    if not qualname:
        return None
    try:
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None
    return target if isinstance(target, type) else None


def inherited_privates(
    trees: dict[str, ast.AST], load_class=_load_class
) -> list[tuple[str, int, str, list[str]]]:
    """(module, line, name, the other modules defining it) for each `self._name` read where
    `_name` is defined in other modules of `trees` (module name -> tree) only, and by no
    base class of another library."""
    defined = {module: own_names(tree) for module, tree in trees.items()}
    found = []
    for module, tree in trees.items():
        for line, name, qualname in _self_reads(tree):
            if name in defined[module]:
                continue
            elsewhere = sorted(other for other, names in defined.items() if name in names)
            if not elsewhere:
                continue  # Another library's, through self: the rule above.
            cls = load_class(module, qualname)
            if _defined_by_a_library_base(cls, name):
                continue
            # Where the class inherits it from, where that can be told; else every candidate.
            bases = {base.__module__ for base in (cls.__mro__[1:] if cls else ())}
            found.append((module, line, name, [m for m in elsewhere if m in bases] or elsewhere))
    return found


def _our_modules() -> dict[str, tuple[str, ast.AST]]:
    """Module name -> (its file, its tree), for every module outside the internals modules."""
    return {
        _module_name(path.relative_to(ROOT)).removesuffix(".__init__"): (
            path.relative_to(ROOT).as_posix(),
            ast.parse(path.read_text(), str(path)),
        )
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in INTERNALS
    }


def test_our_privates_stay_home():
    modules = _our_modules()
    on_other_objects = [
        f"{file}:{line}: {name} ({obj})"
        for file, tree in modules.values()
        for line, name, obj in accesses(tree)
    ]
    inherited = [
        f"{modules[module][0]}:{line}: self.{name} (defined in {', '.join(elsewhere)} only)"
        for module, line, name, elsewhere in inherited_privates(
            {module: tree for module, (_, tree) in modules.items()}
        )
    ]
    assert not on_other_objects + inherited, (
        "Private names of ours read outside the object or the module they belong to: give "
        "each a public name (a property, a method) or move the code that reads it:\n  "
        + "\n  ".join(on_other_objects + inherited)
    )


def test_the_stricter_walk_finds_reads_on_other_objects_of_the_same_class():
    """What the module rule leaves (a class's own names, on a copy of itself, on its type)."""
    tree = ast.parse(
        textwrap.dedent(
            """
            class Schedule:
                _decay = staticmethod(abs)

                def __init__(self):
                    self._total = 0

                def with_total_steps(self, total):
                    bound = copy.copy(self)
                    bound._total = total
                    return type(self)._decay(bound._total)
            """
        )
    )
    assert violations(pathlib.Path("x.py"), ast.unparse(tree), set()) == []
    assert sorted((name, obj) for _, name, obj in accesses(tree)) == [
        ("_decay", "type(self)"),
        ("_total", "bound"),
        ("_total", "bound"),
    ]


def test_the_stricter_walk_finds_inherited_privates_but_not_keras_own():
    base = """
        class Base:
            _table = ()

            def __init__(self):
                self._total = 1
                self._model = None
        """
    sub = """
        import keras
        from keras_accel.x.base import Base

        class Sub(Base):
            def value(self):
                return self._total, self._table, getattr(self, "_total"), self._mine

            def _mine(self):
                return self._total

        class Hook(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                return self._model
        """
    namespace = {"keras": __import__("keras")}
    exec(
        textwrap.dedent(sub).replace("from keras_accel.x.base import Base", ""),
        {**namespace, "Base": type("Base", (), {})},
        namespace,
    )
    trees = {
        "keras_accel.x.base": ast.parse(textwrap.dedent(base)),
        "keras_accel.x.sub": ast.parse(textwrap.dedent(sub)),
    }
    found = inherited_privates(trees, lambda module, qualname: namespace.get(qualname))
    assert [(module, name) for module, _, name, _ in found] == [
        ("keras_accel.x.sub", "_total"),
        ("keras_accel.x.sub", "_table"),
        ("keras_accel.x.sub", "_total"),
        ("keras_accel.x.sub", "_total"),
    ]
