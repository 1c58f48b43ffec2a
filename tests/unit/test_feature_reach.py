"""How far an optional feature reaches into the rest of the package (docs/design.md, "A feature is a folder").

Two ratchets, each only going down:

- *Imported by*: every folder of ``torchtitan/features/`` is imported by at most ``MAX_FILES_OUTSIDE`` modules of
  torchtitan outside it (any import, type-only ones included, and a module path in a string: the registry's
  ``"module:function"``). ``IMPORT_LIMITS`` holds where each stands. Before this rule (feb7389, round 5):
  documents 7, in_backward 3, float8 2, linear_attention 1, validation, replay, stragglers, moe_balance 1 each;
  outside features/: LoRA 3, fault tolerance 2, RL 4 (its own two drivers among them), the [eval] loop 2.
- *Named in*: a feature is *named* in a file when the file's code (identifiers, imports, attribute names and
  string literals such as config keys, with comments and docstrings left out) matches the feature's pattern;
  each may be named in at most ``MAX_FILES_OUTSIDE`` files outside its own folders: the feature registry, the
  schema root and one more (its config section, ``config/sections/<name>.py``, and the moved-module table,
  ``torchtitan/__init__.py``, are its own). Measured with this rule on eae35a6 (before the engine): LoRA 15, fault
  tolerance 20, step replay 6 (its own two files aside), evaluation 7; at feb7389 LoRA 3, fault tolerance 2,
  step replay 3, evaluation 3.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "torchtitan"
MAX_FILES_OUTSIDE = 3  # the target (the registry, the schema root, one more)
# Where each feature stands now: a ratchet, lowered as features move into their folders, never raised.
LIMITS = {"lora": 2, "fault_tolerance": 2, "replay": 3, "eval": 2}
IMPORT_LIMITS = {
    "cuda_graphs": 1,
    "documents": 1,
    "fault_tolerance": 2,
    "float8": 1,
    "in_backward": 1,
    "in_loop_eval": 2,
    "lora": 2,
    "moe_balance": 1,
    "mtp": 2,  # the registry (its check) and build.py (the loss and hooks, beside the step function it builds)
    "replay": 1,
    "rl": 3,
    "stragglers": 1,
    "validation": 1,
}

# feature -> (its folders under torchtitan/, the pattern that names it)
FEATURES: dict[str, tuple[tuple[str, ...], re.Pattern]] = {
    # MLA's q_lora_rank / kv_lora_rank and DeepSeek-V4's grouped low-rank output (o_lora_rank) are not it
    "lora": (("features/lora",), re.compile(r"(?<![qvo]_)lora", re.IGNORECASE)),
    "fault_tolerance": (
        ("features/fault_tolerance",),
        re.compile(r"fault_tol|torchft|replica(?!te|tion)", re.IGNORECASE),
    ),
    "replay": (("features/replay",), re.compile(r"replay", re.IGNORECASE)),
    # the [eval] section, its loop and the lm-eval backend; a module's own ``.eval()`` mode switch is not it
    "eval": (
        ("eval", "features/in_loop_eval"),
        re.compile(r"torchtitan\.eval\b|\bschema_eval\b|evaluator|lm_eval|\beval\.(?!\()|\bEval\b"),
    ),
}
# A feature's own files outside its folders: its config section, and the table of moved module paths.
OWN_ELSEWHERE = ("config/sections/{name}.py", "__init__.py")
# Foreign configurations' translation (upstream's 2025 keys, 2026 recipe classes and their mapping onto ours) names
# every feature upstream has, because upstream does; it is kept in one namespace on purpose (issue 88), so not counted.
TRANSLATION = "config/compat"


def _docstring_nodes(tree: ast.Module) -> set[tuple[int, int]]:
    """(line, col) of every docstring: the first statement of a module, class or function, a bare string."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found.add((first.lineno, first.col_offset))
        # a bare string after an attribute (the house's field docstrings) is documentation too
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found.add((node.lineno, node.col_offset))
    return found


# In a string, what names a feature is a config key, a module path or an identifier ("lora.rank",
# "torchtitan.features.in_loop_eval.loop:build", "fault_tolerance"): a word with a dot or an underscore; plain words are prose.
_KEY_LIKE = re.compile(r"[A-Za-z_][\w]*(?:[._:][\w]+)+")


def code_without_prose(text: str) -> str:
    """``text`` without comments, docstrings and the prose in strings; identifiers and the key-like words of other
    string literals (config keys, module paths) stay."""
    docstrings = _docstring_nodes(ast.parse(text))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING:
            if tok.start not in docstrings:
                out.extend(_KEY_LIKE.findall(tok.string))
            continue
        out.append(tok.string)
    return " ".join(out)


def files_naming(feature: str, root: Path = PACKAGE_ROOT) -> list[str]:
    """The files of ``root`` outside the feature's folders (and its own files elsewhere) whose code names it."""
    folders, pattern = FEATURES[feature]
    own = [root / folder for folder in (*folders, TRANSLATION)]
    own_files = {root / f.format(name=feature) for f in OWN_ELSEWHERE}
    found = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or path in own_files or any(o in path.parents for o in own):
            continue
        if pattern.search(code_without_prose(path.read_text(encoding="utf-8"))):
            found.append(path.relative_to(root.parent).as_posix())
    return found


def test_prose_is_not_code():
    text = '"""LoRA here."""\nx = 1  # lora\ny = "lora.rank"\nz = "adapters of LoRA"\n'
    code = code_without_prose(text)
    assert "lora.rank" in code
    assert "LoRA" not in code and "# lora" not in code


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_feature_is_named_in_few_files_outside_its_folder(feature):
    found = files_naming(feature)
    assert len(found) <= LIMITS[feature], (
        f"{feature} is named in {len(found)} files outside {FEATURES[feature][0]}, more than its "
        f"{LIMITS[feature]} (the target is {MAX_FILES_OUTSIDE}: the registry, the schema root, one more): {found}"
    )


# --------------------------------------------------------------------------- imported by


def _module(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ()]+)|import\s+([\w.]+))", re.MULTILINE)
_DOTTED = re.compile(r"torchtitan(?:\.\w+)+")


def modules_importing(folder: Path, root: Path = PACKAGE_ROOT) -> list[str]:
    """The modules of ``root`` outside ``folder`` that import a module inside it: an import statement (at any depth,
    type-only ones included) or a dotted module path in a string (``Deferred("torchtitan.x.y:fn")``)."""
    package = _module(folder / "__init__.py", root)
    inside = re.compile(re.escape(package) + r"(?:\.|$)")
    found = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or folder in path.parents:
            continue
        text = path.read_text(encoding="utf-8")
        named = _DOTTED.findall(text)
        for module, names, plain in _IMPORT.findall(text):
            base = module or plain
            named += [base, *(f"{base}.{n.strip(' ()')}" for n in names.split(",") if n.strip(" ()"))]
        if any(inside.match(n) for n in named):
            found.append(_module(path, root))
    return found


def feature_folders(root: Path = PACKAGE_ROOT) -> list[str]:
    return sorted(p.name for p in (root / "features").iterdir() if (p / "__init__.py").is_file())


def test_import_counter_on_a_synthetic_package(tmp_path):
    pkg = tmp_path / "torchtitan"
    files = {
        "__init__.py": "",
        "features/__init__.py": "",
        "features/a/__init__.py": "",
        "features/a/x.py": "from torchtitan.features.a import y\n",  # inside: not counted
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torchtitan.features.a.x import T\n",
        "c.py": 'F = Deferred("torchtitan.features.a.x:build")\n',
        "d.py": "from torchtitan.features import a\n",
        "e.py": "from torchtitan.features.ab import z\n",  # another folder whose name starts alike
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert modules_importing(pkg / "features" / "a", pkg) == ["torchtitan.b", "torchtitan.c", "torchtitan.d"]


def test_every_feature_folder_has_a_limit():
    assert set(feature_folders()) == set(IMPORT_LIMITS), "add the new feature folder to IMPORT_LIMITS"


@pytest.mark.parametrize("feature", sorted(IMPORT_LIMITS))
def test_feature_folder_is_imported_by_few_modules(feature):
    found = modules_importing(PACKAGE_ROOT / "features" / feature)
    assert len(found) <= min(IMPORT_LIMITS[feature], MAX_FILES_OUTSIDE), (
        f"torchtitan/features/{feature}/ is imported by {len(found)} modules outside it, more than its "
        f"{IMPORT_LIMITS[feature]} (at most {MAX_FILES_OUTSIDE}): {found}; reach it through the registry's slots"
    )
