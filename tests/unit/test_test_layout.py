"""The tests read as a map (docs/testing.md, "Layout"): the harness in tests/support/, tests that import no test.

- no module of tests/, bench/ or scripts/ imports a test module (``test_*``): what two test files share lives
  in tests/support/, once;
- every module of tests/ outside tests/support/ is a test file (``test_*.py``), ``conftest.py`` or ``__init__.py``;
  tests/support/ holds no test file; the tests root holds no test file (run tests sit in tests/runs/<concern>/).

Read with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "bench", "scripts")
NOT_TESTS = ("conftest.py", "__init__.py")


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def imports_of_test_modules(repo: Path = REPO) -> list[str]:
    """Each ``import`` of a test module in tests/, bench/ and scripts/, as ``path:line: module``."""
    found = []
    for folder in SCANNED:
        for path in sorted((repo / folder).rglob("*.py")):
            if "assets" in path.relative_to(repo).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:  # the module, or a module named from a package
                    modules = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                else:
                    continue
                found += [f"{path.relative_to(repo)}:{node.lineno}: {m}" for m in modules if _is_test_module(m)]
    return found


def misplaced_modules(repo: Path = REPO) -> list[str]:
    """Modules of tests/ outside their place: a helper outside tests/support/, a test inside it or at the root."""
    tests = repo / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] == "assets" or path.name in NOT_TESTS:
            continue
        is_test = path.name.startswith("test_")
        if rel.parts[0] == "support" and is_test:
            found.append(f"tests/{rel}: a test file in tests/support/ (the harness only)")
        elif rel.parts[0] != "support" and not is_test:
            found.append(f"tests/{rel}: a helper module outside tests/support/")
        elif len(rel.parts) == 1:
            found.append(f"tests/{rel}: a test file at the tests root (run tests sit in tests/runs/<concern>/)")
    return found


def test_no_module_imports_a_test_module():
    imports = imports_of_test_modules()
    assert not imports, "move what these take from a test module into tests/support/:\n" + "\n".join(imports)


def test_tests_sit_where_the_layout_says():
    misplaced = misplaced_modules()
    assert not misplaced, "docs/testing.md, 'Layout':\n" + "\n".join(misplaced)


def test_the_checks_on_a_synthetic_tree(tmp_path):
    files = {
        "tests/__init__.py": "",
        "tests/conftest.py": "from tests.support.rows import ROWS\n",
        "tests/support/rows.py": "ROWS = []\n",
        "tests/runs/__init__.py": "",
        "tests/runs/models/test_a.py": "from tests.support.rows import ROWS\n",
        "tests/unit/test_b.py": "def f():\n    from tests.runs.models.test_a import ROWS\n",  # function-local
        "tests/unit/test_c.py": "from tests.runs.models import test_a\nimport tests.unit.test_b as b\n",
        "tests/unit/helpers.py": "",
        "tests/support/test_d.py": "",
        "tests/test_e.py": "",
        "tests/assets/tool.py": "from tests.unit.test_b import f\n",  # data, not scanned
        "bench/x.py": "from tests.unit.test_b import f\n",
        "scripts/y.py": "import json\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert imports_of_test_modules(tmp_path) == [
        "tests/unit/test_b.py:2: tests.runs.models.test_a",
        "tests/unit/test_c.py:1: tests.runs.models.test_a",
        "tests/unit/test_c.py:2: tests.unit.test_b",
        "bench/x.py:1: tests.unit.test_b",
    ]
    assert misplaced_modules(tmp_path) == [
        "tests/support/test_d.py: a test file in tests/support/ (the harness only)",
        "tests/test_e.py: a test file at the tests root (run tests sit in tests/runs/<concern>/)",
        "tests/unit/helpers.py: a helper module outside tests/support/",
    ]
