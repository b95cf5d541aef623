"""The README's set-up commands are the ones CI runs, and they install the pinned versions."""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _commands() -> list[str]:
    return [m.strip() for m in re.findall(r"^    (pip install .+)$", README, flags=re.M)]


def test_exactly_two_setup_commands_both_with_the_constraints():
    commands = _commands()
    assert len(commands) == 2, commands
    for command in commands:
        assert command.startswith("pip install -c constraints.txt -e "), command


def test_ci_runs_the_readme_test_command_verbatim():
    test_command = next(c for c in _commands() if "scripts/test.sh" in c)
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"README_TEST_COMMAND='{test_command}'" in ci


def test_the_test_command_installs_every_extra():
    # tests/test_install.py checks every extra of pyproject.toml against the pinned set in the
    # environment this command made, and tests/object_stores.py's servers come with `test`: an
    # extra the command leaves out would go unchecked (or the object-store tests skip).
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    test_command = next(c for c in _commands() if "scripts/test.sh" in c)
    asked = set(re.search(r'-e "\.\[([a-z,]+)\]"', test_command).group(1).split(","))
    installed, pending = set(), list(asked)
    while pending:
        extra = pending.pop()
        if extra in installed:
            continue
        installed.add(extra)
        for requirement in extras[extra]:
            own = re.fullmatch(r"keras-accel\[([a-z,]+)\]", requirement)
            pending += own.group(1).split(",") if own else []
    assert installed == set(extras), sorted(set(extras) - installed)


def test_constraints_pin_every_package_exactly():
    lines = [
        line
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    names = {re.split(r"==", line)[0].lower().replace("_", "-") for line in lines}
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line) for line in lines)
    # What the suite needs is pinned, and keras_accel itself is not.
    needed = {"keras", "jax", "tensorflow", "torch", "keras-hub", "pytest", "ruff", "numpy"}
    # torch needs setuptools>=77 and tensorflow needs wheel; pip freeze leaves both out.
    assert needed | {"setuptools", "wheel"} <= names
    assert "keras-accel" not in names
    # No local version label: a package index serves no torch '+cpu', so such a pin would fail
    # to resolve on a machine without the local CPU wheel (pip freeze writes one: drop it).
    assert not [line for line in lines if "+" in line]


def _project_files() -> list:
    """The project's files: git's (tracked, and untracked but not ignored), so that what a
    developer keeps in ignored folders (a `.venv/` in the checkout) is not read; every file
    under the root where git is not there."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        return list(ROOT.rglob("*"))
    return [ROOT / name for name in listed.split("\0") if name]


def test_no_absolute_path_of_this_machine_in_the_project():
    suffixes = {".py", ".md", ".sh", ".toml", ".txt", ".cfg"}
    files = [p for p in _project_files() if p.is_file() and p.suffix in suffixes]
    files += [ROOT / ".ci" / "run"]
    pattern = re.compile(r"/work/|/home/\w+/|/Users/\w+/")
    offenders = []
    for path in files:
        parts = path.relative_to(ROOT).parts
        if parts[0] in {".git", "build", "dist"} or parts[0].endswith(".egg-info"):
            continue
        if path.name == "test_readme.py":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
