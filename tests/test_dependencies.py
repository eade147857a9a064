"""pyproject.toml's dependencies: what a plain ``pip install`` brings is what the commands need, and each lower bound
is a version that scripts/check_versions.py ran with (the main job and the exactness tests) and passed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from lightning_dos.commands import report

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_versions.py"


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _dependencies() -> dict[str, Requirement]:
    return {re.sub(r"[-_.]+", "-", r.name).lower(): r for r in map(Requirement, _project()["dependencies"])}


def _script():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("check_versions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lower_bound(requirement: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(bounds) if bounds else None


def test_every_lower_bound_is_a_version_the_check_passed_with() -> None:
    verified = _script().VERIFIED
    dependencies = _dependencies()
    assert set(verified) == set(dependencies), "check_versions.VERIFIED names each dependency of pyproject.toml"
    for name, requirement in dependencies.items():
        bound = _lower_bound(requirement)
        assert bound is not None, f"{name} has no lower bound"
        assert bound == Version(verified[name]), f"{name}>={bound} where the check ran {verified[name]}"
        assert requirement.specifier.contains(verified[name]), f"{requirement} excludes the version checked"


def test_report_needs_nothing_beyond_the_packages_dependencies() -> None:
    """What `report` imports installs with the package: matplotlib is a dependency, and the ``plot`` extra that once
    held it stays, empty, for install commands that still name it."""
    assert "matplotlib" in _dependencies()
    assert _project()["optional-dependencies"]["plot"] == []
    hint = report.INSTALL_HINT.split("'")[1]
    assert Requirement(hint).specifier == _dependencies()["matplotlib"].specifier, "the hint asks for pyproject's bound"


def test_a_version_set_is_exact_pins_with_torch_among_them() -> None:
    check_versions = _script()
    pins = check_versions.parse_pins(["torch==2.13.0", "jsonargparse[signatures]==4.27.7", "PyYAML==6.0"])
    assert pins == {
        "torch": ("torch==2.13.0", "2.13.0"),
        "jsonargparse": ("jsonargparse[signatures]==4.27.7", "4.27.7"),
        "pyyaml": ("PyYAML==6.0", "6.0"),
    }
    with pytest.raises(ValueError, match="pin torch too"):
        check_versions.parse_pins(["lightning==2.6.0"])
    with pytest.raises(ValueError, match="not an exact pin"):
        check_versions.parse_pins(["torch==2.13.0", "lightning>=2.6"])
    with pytest.raises(ValueError, match="pinned twice"):
        check_versions.parse_pins(["torch==2.13.0", "torch==2.14.1"])
    assert check_versions.CUDA_PACKAGES.match("nvidia-cublas") and not check_versions.CUDA_PACKAGES.match("numpy")


def test_the_script_refuses_a_set_without_torch_before_installing_anything() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "lightning==2.6.0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and "pin torch too" in done.stderr, done.stderr
