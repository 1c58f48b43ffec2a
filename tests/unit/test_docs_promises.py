"""What the README and the docs promise about themselves, checked against the code (issue 84, item 11)."""

from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README_WORDS = 900  # the README is a 2-minute read: at most 900 words (as `wc -w` counts them); detail goes to docs/


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_the_readme_is_a_two_minute_read():
    words = len(_read("README.md").split())
    assert words <= README_WORDS, f"README.md has {words} words, over {README_WORDS}: move detail into docs/"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", ""))


def test_the_docs_say_generate_py_s_default_tokenizer_as_its_help_does():
    """docs/models.md (Generation) and docs/sft.md (generate --chat) name generate.py's default --tokenizer in the
    words of its --help, which says what default_tokenizer does."""
    spec = importlib.util.spec_from_file_location("generate_script", os.path.join(ROOT, "scripts", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (action,) = [a for a in module._parser()._actions if "--tokenizer" in a.option_strings]
    default = _flat(action.help.split("default: ", 1)[1])
    assert default.startswith("the one the checkpoint's run recorded"), action.help
    for doc in ("docs/models.md", "docs/sft.md"):
        assert f"default: {default}" in _flat(_read(doc)), f"{doc} does not name generate.py's default as --help does"
