"""Every extra installs with the pinned set, checked offline.

The README installs with `-c constraints.txt`; a pin that contradicts what another pinned
package requires leaves pip no solution (python-dateutil==4.0.0 against every botocore's
`<3.0.0`, through s3fs -> aiobotocore, backtracked for minutes and failed). CI's install would
say so, but only with a network and a pip run; here the installed distributions' metadata
says it: every requirement of every extra in pyproject.toml, followed through the
requirements of what it names (at the pinned version where constraints.txt pins one), is met,
and every pinned distribution that is installed has its pinned version.
"""

import importlib.metadata as metadata
import os
import pathlib

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

# .ci/run's other modes install off the pins on purpose: the newest releases
# (KERAS_ACCEL_CI_LATEST=1), Keras's nightly in place of keras (KERAS_ACCEL_CI_KERAS=nightly).
pytestmark = pytest.mark.skipif(
    os.environ.get("KERAS_ACCEL_CI_LATEST", "0") == "1"
    or bool(os.environ.get("KERAS_ACCEL_CI_KERAS")),
    reason="CI installed without constraints.txt or with Keras's nightly on purpose "
    "(KERAS_ACCEL_CI_LATEST / KERAS_ACCEL_CI_KERAS)",
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SELF = canonicalize_name(PROJECT["name"])
INSTALL = 'pip install -c constraints.txt -e ".[all,test]"'


def _pins(text: str) -> dict:
    pins = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _installed() -> dict:
    """name: (version, requirements), each distribution's metadata read once (every read of
    importlib.metadata's `.version` or `.requires` parses the file again)."""
    found = {}
    for dist in metadata.distributions():
        meta = dist.metadata
        if meta["Name"]:  # a half-removed distribution's leftover folder has no metadata
            requires = meta.get_all("Requires-Dist") or []
            found.setdefault(canonicalize_name(meta["Name"]), (meta["Version"], requires))
    return found


def _applies(requirement: Requirement, extras) -> bool:
    if requirement.marker is None:
        return True
    environment = default_environment()
    return any(requirement.marker.evaluate({**environment, "extra": e}) for e in extras)


def _check(pins: dict, installed: dict):
    """Walk every extra's requirements through the installed metadata. Returns the unmet
    requirements (as sentences) and the distributions reached."""
    own = {"": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    problems, reached, seen = [], set(), set()
    # (who asks, requirement, the extras of who asks that the requirement's marker may name)
    pending = [(f"{SELF}[{extra}]", r, ("",)) for extra in own for r in own[extra]]
    while pending:
        asker, text, asker_extras = pending.pop()
        requirement = Requirement(text)
        if not _applies(requirement, asker_extras):
            continue
        name = canonicalize_name(requirement.name)
        extras = ("", *sorted(requirement.extras))
        if name == SELF:  # keras-accel[jax,...]: its own extras, read from pyproject.toml
            pending += [(f"{SELF}[{e}]", r, ("",)) for e in extras if e for r in own[e]]
            continue
        if name not in installed:
            problems.append(f"{asker} requires {text}: not installed (install with {INSTALL})")
            continue
        reached.add(name)
        installed_version, requires = installed[name]
        version = Version(installed_version)
        # What pip would take with -c constraints.txt: the pin, where the installed build is
        # another version (torch's "2.13.0+cpu" is the pin's 2.13.0).
        if name in pins and version.public != str(pins[name]):
            version = pins[name]
        if not requirement.specifier.contains(version, prereleases=True):
            source = "pinned" if name in pins else "installed"
            problems.append(f"{asker} requires {text}; {source}: {requirement.name}=={version}")
        if (name, extras) not in seen:
            seen.add((name, extras))
            pending += [(f"{name}=={installed_version}", r, extras) for r in requires]
    return problems, reached


PINS = _pins((ROOT / "constraints.txt").read_text())
INSTALLED = _installed()


def test_every_extra_is_satisfied_by_the_pinned_versions():
    problems, _ = _check(PINS, INSTALLED)
    assert not problems, "\n".join(sorted(set(problems)))


def test_installed_distributions_have_their_pinned_versions():
    differ = [
        f"{name}: installed {INSTALLED[name][0]}, pinned {pin} (reinstall with {INSTALL})"
        for name, pin in sorted(PINS.items())
        if name in INSTALLED and Version(INSTALLED[name][0]).public != str(pin)
    ]
    assert not differ, "\n".join(differ)


def test_everything_the_extras_need_is_pinned():
    # A new dependency (or one that an upgrade brings in) unpinned would be resolved afresh on
    # every install: the pinned set would no longer be the one the suite passed with.
    _, reached = _check(PINS, INSTALLED)
    unpinned = sorted(reached - set(PINS))
    assert not unpinned, f"required by an extra but not in constraints.txt: {unpinned}"


def test_the_check_finds_a_pin_that_contradicts_a_requirement():
    # The pin that made `.[remote]` uninstallable: every botocore requires python-dateutil<3.
    if "botocore" not in INSTALLED:
        pytest.skip(f"botocore is not installed (the `remote` extra): {INSTALL}")
    pins = {**PINS, canonicalize_name("python-dateutil"): Version("4.0.0")}
    problems, _ = _check(pins, INSTALLED)
    assert any(
        p.startswith("botocore==") and "python-dateutil" in p and "pinned" in p for p in problems
    ), problems
