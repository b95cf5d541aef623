"""The package's layers import downward only, and no module imports itself back.

    utils -> data, state, schedules -> adapter core, models -> Accelerator, loop
          -> callbacks -> benchmark -> keras_accel (the public API) -> cli

Every `import` is read from the source (those inside functions too): a lazy import that
goes upward is the same dependency, only hidden.
"""

import ast
import pathlib

import keras_accel

PACKAGE = pathlib.Path(keras_accel.__file__).parent

# Longest prefix wins. A module may import its own layer and the ones below.
LAYERS = {
    "keras_accel.utils": 0,
    "keras_accel.data": 1,
    "keras_accel.state": 1,
    "keras_accel.schedules": 1,
    "keras_accel.models": 2,
    "keras_accel.adapter": 2,  # the core: plan, runtime, feeder, session, steps
    "keras_accel.adapter.accelerator": 3,
    "keras_accel.loop": 3,
    "keras_accel.callbacks": 4,
    "keras_accel.benchmark": 5,
    "keras_accel": 6,  # the curated public API (find_batch_size is the benchmark's)
    "keras_accel.cli": 7,
}


def _module_name(path: pathlib.Path) -> str:
    parts = ("keras_accel", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def _imports() -> dict[str, set[str]]:
    """module -> the keras_accel modules it imports (a `from X import y` of a submodule y
    counts as importing X.y)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("keras_accel")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # Relative: from the module's own package up.
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                if not base.startswith("keras_accel"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
        graph[name] = {m for m in found if m != name}
    return graph


def test_every_import_goes_downward():
    upward = [
        f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)})"
        for source, targets in sorted(_imports().items())
        for target in sorted(targets)
        if _layer(target) > _layer(source)
    ]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_module_imports_itself_back():
    graph = _imports()
    cycles, done = [], set()

    def visit(module, path):
        if module in path:
            cycles.append(" -> ".join(path[path.index(module) :] + [module]))
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def test_the_public_names_load_from_below_the_public_api():
    """`keras_accel.X` loads its module by name on first use (not an import the walk sees)."""
    upward = {n: m for n, m in keras_accel._PUBLIC.items() if _layer(m) > LAYERS["keras_accel"]}
    assert not upward, upward


def test_the_layers_name_every_package():
    """A new package gets its place here, decided, not by default."""
    packages = {_module_name(p / "__init__.py") for p in PACKAGE.iterdir() if p.is_dir()}
    packages.discard("keras_accel.__pycache__")
    assert packages <= set(LAYERS), sorted(packages - set(LAYERS))
