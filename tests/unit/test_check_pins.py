"""scripts/check_pins.py: CI's one-line check that the installed packages are the pinned ones."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_pins", ROOT / "scripts" / "check_pins.py")
check_pins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_pins)
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"


def test_ci_pins_every_test_dependency_exactly():
    pins = check_pins.read_pins(CONSTRAINTS)
    for name in ("pytest", "transformers", "datasets", "torchao", "torchft", "matplotlib", "ruff", "torch"):
        assert name in pins, name


def test_a_drifted_or_missing_package_is_named(tmp_path, capsys):
    pytest_version = metadata.version("pytest")
    pins = tmp_path / "constraints.txt"
    pins.write_text(f"# a comment\npytest=={pytest_version}\npackaging==0.0.1\nno-such-package-here==1.0\n")
    assert check_pins.main([str(pins)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert f"packaging: installed {metadata.version('packaging')}, pinned 0.0.1" in err[0]
    assert "no-such-package-here: not installed, pinned 1.0" in err[0]
    assert "pytest:" not in err[0]


def test_local_labels_match_and_open_pins_are_refused(tmp_path):
    pins = tmp_path / "constraints.txt"
    pins.write_text(f"torch=={metadata.version('torch').split('+')[0]}\n")  # 2.13.0 pins 2.13.0+cpu
    assert check_pins.main([str(pins)]) == 0
    pins.write_text("pytest>=8\n")
    with pytest.raises(ValueError, match="not an exact pin"):
        check_pins.read_pins(pins)
