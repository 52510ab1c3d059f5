"""requirements.lock (what `make setup` installs, with nothing resolved) against pyproject.toml's
requirements: every requirement of the package and of the test and explore extras is pinned in the
lock at a version it accepts, and the environment running the suite holds those versions."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("test", "explore")  # what `make setup` installs


def _lock() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, line in enumerate((ROOT / "requirements.lock").read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"requirements.lock line {number}: {line!r} is not an exact pin (name==version)"
        key = canonicalize_name(name)
        assert key not in pins, f"requirements.lock line {number}: {name} pinned twice"
        pins[key] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"]) + [text for extra in EXTRAS for text in project["optional-dependencies"][extra]]
    return [Requirement(text) for text in texts]


def test_every_requirement_is_pinned_at_a_version_it_accepts():
    pins = _lock()
    for requirement in _requirements():
        key = canonicalize_name(requirement.name)
        assert key in pins, f"pyproject.toml asks for {requirement} but requirements.lock does not pin {requirement.name}: run `make lock`"
        assert requirement.specifier.contains(pins[key], prereleases=True), (
            f"requirements.lock pins {requirement.name}=={pins[key]}, outside pyproject.toml's {requirement}: run `make lock`"
        )


def test_torch_is_the_readme_pin():
    assert _lock()[canonicalize_name("torch")] == Version("2.13.0")


def test_the_suite_runs_on_the_locked_versions():
    """A stale .venv (installed before the lock changed) would test other versions than CI's."""
    for key, version in _lock().items():
        if key == "setuptools":
            continue  # the build backend, not imported by the package
        installed = Version(importlib.metadata.version(key))
        assert Version(installed.public) == version, (  # torch 2.13.0+cpu is the pin 2.13.0
            f"{key} {installed} is installed but requirements.lock pins {version}: run `make setup`"
        )


def test_a_pin_outside_a_requirement_is_seen():
    """The check above can fail: a lock with numpy below pyproject's bound is refused."""
    pins = _lock()
    pins[canonicalize_name("numpy")] = Version("1.0")
    bad = [r for r in _requirements() if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert [r.name for r in bad] == ["numpy"]
