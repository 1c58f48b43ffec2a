"""How far an optional feature reaches into the rest of the package (docs/design.md, "A feature is a folder").

A feature is *named* in a file when the file's code — identifiers, imports, attribute names and string literals
such as config keys, with comments and docstrings left out — matches the feature's pattern. Each feature may be
named in at most ``MAX_FILES_OUTSIDE`` files of torchtitan/ outside its own folder: the feature registry, the
schema root (the config section's home in the ``config/`` leaf) and one more. ``LIMITS`` holds where each stands
now and only goes down. Measured with this file's own rule on eae35a6 (before the engine): LoRA 15, fault
tolerance 20, step replay 6 (its own two files aside), evaluation 7; now LoRA 3 (registry, schema, build.py: the
model transform), fault tolerance 2 (registry, schema), step replay 3, evaluation 3.
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
LIMITS = {"lora": 3, "fault_tolerance": 2, "replay": 3, "eval": 3}

# feature -> (its folder under torchtitan/, the pattern that names it)
FEATURES: dict[str, tuple[str, re.Pattern]] = {
    "lora": ("lora", re.compile(r"(?<![qv]_)lora", re.IGNORECASE)),  # MLA's q_lora_rank / kv_lora_rank are not it
    "fault_tolerance": ("fault_tolerance", re.compile(r"fault_tol|torchft|replica(?!te|tion)", re.IGNORECASE)),
    "replay": ("features/replay", re.compile(r"replay", re.IGNORECASE)),
    # the [eval] section, its loop and the lm-eval backend; a module's own ``.eval()`` mode switch is not it
    "eval": ("eval", re.compile(r"torchtitan\.eval\b|\bschema_eval\b|evaluator|lm_eval|\beval\.(?!\()|\bEval\b")),
}


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
# "torchtitan.eval.loop:build", "fault_tolerance"): a word with a dot or an underscore; plain words are prose.
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
    """The files of ``root`` outside the feature's folder whose code names it."""
    folder, pattern = FEATURES[feature]
    own = root / folder
    found = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or own in path.parents:
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
        f"{feature} is named in {len(found)} files outside torchtitan/{FEATURES[feature][0]}/, more than its "
        f"{LIMITS[feature]} (the target is {MAX_FILES_OUTSIDE}: the registry, the schema root, one more): {found}"
    )
