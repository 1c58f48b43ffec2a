"""Fail in one line when an installed package differs from its pin in a constraints file (CI's first check).

    python scripts/check_pins.py [.ci/constraints.txt]

A fresh machine resolves open requirements to new releases (pytest 9.2 broke a teardown that stayed green
on machines with pytest 8): CI installs with the constraints file and then checks that what is installed is
what the file says, so a drift shows as one line naming the package, not as a test failing elsewhere.
Exit 0 when every pinned package is installed at its version, 1 otherwise.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one exact pin per line
        if spec.operator != "==":
            raise ValueError(f"{path}: '{line}' is not an exact pin (name==version)")
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def mismatches(pins: dict[str, str]) -> list[str]:
    """'name: installed X, pinned Y' for each pin the environment does not hold (a local label like +cpu is ignored)."""
    found = []
    for name, pinned in sorted(pins.items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            found.append(f"{name}: not installed, pinned {pinned}")
            continue
        if Version(installed).public != Version(pinned).public:
            found.append(f"{name}: installed {installed}, pinned {pinned}")
    return found


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else Path(__file__).resolve().parents[1] / ".ci" / "constraints.txt")
    bad = mismatches(read_pins(path))
    if bad:
        print(f"error: installed packages differ from {path}: {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
