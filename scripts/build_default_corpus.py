"""Build the shipped default text corpus from the Python standard library.

The corpus is made only of text every CPython install already has, so training works offline:
the language reference (``pydoc_data.topics.topics``) plus the docstrings of importable standard
library modules and their public members. The output is deterministic for a given Python build.

Usage:
    python scripts/build_default_corpus.py \
        --output torchtitan/datasets/assets/pydocs/pydocs.jsonl --max_bytes 2000000
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import logging
import pkgutil
import sys
import warnings
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = "torchtitan/datasets/assets/pydocs/pydocs.jsonl"
DEFAULT_VAL_OUTPUT = "torchtitan/datasets/assets/pydocs/pydocs_val.jsonl"
MIN_DOC_CHARS = 200

# Modules that open windows/browsers, print on import, need a display, are test suites, or whose
# content depends on third-party packages (distutils is shimmed by setuptools). Matched on the
# first dotted component and on any component for the test-ish names.
SKIP_TOP_LEVEL = {
    "__main__",
    "__hello__",
    "__phello__",
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "distutils",
    "ensurepip",
    "pydoc_data",
    "encodings",
    "msilib",
    "winreg",
    "winsound",
    "msvcrt",
    "_winapi",
    "readline",
    "site",
    "sitecustomize",
    "usercustomize",
}
SKIP_ANY_COMPONENT = {"test", "tests", "idle_test", "__main__"}


def _is_skipped(modname: str) -> bool:
    parts = modname.split(".")
    # private modules are implementation details whose docs duplicate the public wrappers
    return (
        parts[0] in SKIP_TOP_LEVEL
        or any(p in SKIP_ANY_COMPONENT for p in parts)
        or any(p.startswith("_") for p in parts)
    )


def _quiet_import(modname: str) -> ModuleType | None:
    """Import a module with stdout/stderr/warnings swallowed; None if it fails for any reason."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(modname)
        except BaseException:  # noqa: BLE001 - ImportError, SystemExit, OSError... all mean "skip"
            return None


def iter_stdlib_modules() -> list[ModuleType]:
    """Import the public standard-library modules and their public submodules, sorted by name."""
    pending = sorted(n for n in sys.stdlib_module_names if not _is_skipped(n))
    modules: dict[str, ModuleType] = {}
    while pending:
        name = pending.pop(0)
        if name in modules or _is_skipped(name):
            continue
        module = _quiet_import(name)
        if module is None:
            continue
        modules[name] = module
        # recurse into packages without importing them all up front (walk_packages would)
        for info in pkgutil.iter_modules(getattr(module, "__path__", None) or []):
            pending.append(f"{name}.{info.name}")
        pending.sort()
    return [modules[n] for n in sorted(modules)]


def _clean(doc: object) -> str | None:
    if not isinstance(doc, str):
        return None
    text = inspect.cleandoc(doc).strip()
    return text if len(text) > MIN_DOC_CHARS else None


def _defined_here(obj: object, module: ModuleType) -> bool:
    """True for objects defined in `module` or in a private C/Python module it wraps (io <- _io)."""
    owner = getattr(obj, "__module__", None)
    return isinstance(owner, str) and (owner == module.__name__ or owner.startswith("_"))


def _public_members(module: ModuleType) -> list[tuple[str, object]]:
    """Public objects defined in this module (not re-exported), plus public attributes of its classes."""
    out: list[tuple[str, object]] = []
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or not _defined_here(obj, module):
            continue
        out.append((f"{module.__name__}.{name}", obj))
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                if not attr.startswith("_"):
                    out.append((f"{module.__name__}.{name}.{attr}", vars(obj)[attr]))
    return out


def collect_reference() -> list[str]:
    """The language reference topics, sorted by topic name."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics) if len(topics[k].strip()) > MIN_DOC_CHARS]


def collect_docstrings(seen: set[str]) -> list[str]:
    """Module and member docstrings, titled by qualified name, de-duplicated by text."""
    docs: list[str] = []
    for module in iter_stdlib_modules():
        candidates = [(module.__name__, module)] + _public_members(module)
        for qualname, obj in candidates:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # typing.io & co. warn on attribute access
                text = _clean(getattr(obj, "__doc__", None))
            # inherited/shared docstrings repeat verbatim across classes; keep the first only
            if text is None or text in seen:
                continue
            seen.add(text)
            docs.append(f"{qualname}\n\n{text}")
    return docs


def _jsonl_size(text: str) -> int:
    return len(json.dumps({"text": text}).encode()) + 1


def select_documents(docs: list[str], max_bytes: int) -> list[str]:
    """Keep a size-capped subset chosen by content hash (an even spread over the stdlib, not A..M)."""
    by_hash = sorted(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].encode()).hexdigest())
    kept: set[int] = set()
    total = 0
    for i in by_hash:
        size = _jsonl_size(docs[i])
        if total + size > max_bytes:
            continue
        kept.add(i)
        total += size
    return [docs[i] for i in sorted(kept)]  # original order: reference first, then by module name


def write_jsonl(docs: list[str], output: Path) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8", newline="\n") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    return output.stat().st_size


def split_held_out(docs: list[str], every: int) -> tuple[list[str], list[str]]:
    """(training, held-out): every ``every``-th document (the last of each run of ``every``) is held out."""
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    held_out = [d for i, d in enumerate(docs) if i % every == every - 1]
    return train, held_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="JSONL file to write")
    parser.add_argument("--val_output", default=DEFAULT_VAL_OUTPUT, help="held-out JSONL for validation")
    parser.add_argument("--val_every", type=int, default=20, help="every N-th document is held out")
    parser.add_argument("--max_bytes", type=int, default=2_000_000, help="cap on the output size")
    args = parser.parse_args(argv)
    if args.max_bytes < 1_000_000:
        raise ValueError(f"--max_bytes must be >= 1000000 for a useful corpus, got {args.max_bytes}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reference = collect_reference()
    docstrings = collect_docstrings(set(reference))
    # the reference is always kept whole; docstrings fill the rest of the budget
    budget = args.max_bytes - sum(_jsonl_size(t) for t in reference)
    selected = reference + select_documents(docstrings, budget)
    selected, held_out = split_held_out(selected, args.val_every)
    write_jsonl(held_out, Path(args.val_output))
    size = write_jsonl(selected, Path(args.output))
    logger.info(
        "wrote %d documents (%d reference topics, %d of %d docstrings), %d bytes, to %s",
        len(selected),
        len(reference),
        len(selected) - len(reference),
        len(docstrings),
        size,
        args.output,
    )


if __name__ == "__main__":
    main()
