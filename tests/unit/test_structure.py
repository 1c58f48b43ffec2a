"""Structure checks on the torchtitan source, read with ``ast``/``tokenize`` (nothing is imported).

- no import circles, with function-local and ``if TYPE_CHECKING:`` imports counted (a type named in a
  signature is a dependency too);
- ``config/`` is a leaf: it imports nothing from torchtitan outside itself, type-only imports included;
- the pre-launch preflight imports no DTensor / DCP / pipelining / data machinery (it runs before every
  launch; each feature's check lives in a light module beside it);
- files <= 400 lines, functions <= 60 lines, unless marked ``# declarative table``;
- the trainer, metrics, validation and checkpointing code reach MoE / pipeline specifics only
  through the model spec (they never name them);
- ``models/`` holds pure modules: torch, the stdlib and ``torchtitan.models`` only (a family's ``kernels.py`` may
  also import an optional kernel package);
- no file of a folder of the package (its top and features/ aside: folders of folders) sits beside more than 12
  siblings (folders per concern);
- at most one import runs back up the floor plan (a unit placed apart from its folder, imported from below).
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "torchtitan"

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
DECLARATIVE_TABLE = re.compile(r"#\s*declarative table", re.IGNORECASE)

# Files that must reach family (MoE) and layout (pipeline) specifics only through the model spec.
SPEC_ONLY_FILES = (
    "torchtitan/train.py",
    "torchtitan/observability/step_metrics.py",
    "torchtitan/observability/metrics.py",
    "torchtitan/features/validation/validation.py",
)
SPEC_ONLY_FOLDERS = ("torchtitan/checkpointing",)
FAMILY_SPECIFIC = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bmoe",
        r"MoEArgs",
        r"expert",
        r"pipeline",
        r"\bstage",
        r"has_last_stage",
        r"pp_group",
        r"isinstance\([^)]*Args\)",
    )
)


# --------------------------------------------------------------------------- reading the source


def _source(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@functools.cache
def _parse(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename=filename)


def _tree(path: Path) -> ast.Module:
    return _parse(_source(path), str(path))  # keyed on the text: files change under a running session


def _rel(path: Path) -> str:
    """The path as the failure messages show it: relative to the repository root."""
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.as_posix()


def _python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path, root: Path) -> str:
    """``<root>/a/b.py`` -> ``<pkg>.a.b``; ``<root>/a/__init__.py`` -> ``<pkg>.a``."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# --------------------------------------------------------------------------- collecting imports


@dataclass(frozen=True)
class Import:
    """One imported name as written: ``import module`` (name None) or ``from module import name``."""

    line: int
    module: str  # absolute, relative imports already resolved
    name: str | None
    type_only: bool  # inside an ``if TYPE_CHECKING:`` block


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """Every import at any nesting level, with the ``if TYPE_CHECKING:`` ones marked type-only."""

    def __init__(self, package: str):
        self.package = package  # the package a relative import is resolved against
        self.imports: list[Import] = []
        self._type_only = 0

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._type_only += 1
        for stmt in node.body:
            self.visit(stmt)
        self._type_only -= 1
        for stmt in node.orelse:  # the ``else:`` of ``if TYPE_CHECKING:`` runs for real
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node.lineno, alias.name, None)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = self._absolute(node.module, node.level)
        for alias in node.names:
            self._add(node.lineno, module, None if alias.name == "*" else alias.name)

    def visit_Call(self, node: ast.Call) -> None:
        # importlib.import_module("x.y") / __import__("x.y") with a literal name import x.y as well.
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        first = node.args[0] if node.args else None
        literal = first.value if isinstance(first, ast.Constant) else None
        if called in ("import_module", "__import__") and isinstance(literal, str) and not literal.startswith("."):
            self._add(node.lineno, literal, None)
        self.generic_visit(node)

    def _absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        parts = self.package.split(".")
        base = parts[: len(parts) - (level - 1)]
        return ".".join([*base, module] if module else base)

    def _add(self, line: int, module: str, name: str | None) -> None:
        self.imports.append(Import(line, module, name, type_only=self._type_only > 0))


def _imports(path: Path, root: Path) -> list[Import]:
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    collector = _ImportCollector(package)
    collector.visit(_tree(path))
    return collector.imports


# --------------------------------------------------------------------------- the import graph


@dataclass(frozen=True)
class Edge:
    """Why ``src`` imports ``dst``: the import statement's line, and what it names."""

    line: int
    imported: str
    via_package_init: bool  # dst is a package whose __init__ runs on the way to ``imported``


def _target(imp: Import, modules: set[str]) -> str | None:
    """The package module an import loads (the submodule for ``from pkg import submodule``)."""
    if imp.name is not None and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    parts = imp.module.split(".")
    while parts and ".".join(parts) not in modules:  # ``import pkg.mod.attr``: the longest module
        parts.pop()
    return ".".join(parts) or None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def build_import_graph(root: Path, *, type_only: bool = False) -> tuple[dict[str, dict[str, Edge]], dict[str, Path]]:
    """``graph[src][dst] = Edge`` over the modules of the package at ``root`` (runtime imports, and with
    ``type_only`` the ``if TYPE_CHECKING:`` ones too).

    Importing ``pkg.a.b.c`` runs the ``pkg.a`` and ``pkg.a.b`` inits first, so the edge to it comes
    with edges to those inits, except to packages the importer is itself inside (their init has
    already started when the importer runs; Python does not import them again). An explicit import
    of an own parent package (``from pkg.a import X`` in ``pkg.a.m``) does count.
    """
    paths = {_module_name(p, root): p for p in _python_files(root)}
    modules = set(paths)
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for src, path in paths.items():
        for imp in _imports(path, root):
            target = None if imp.type_only and not type_only else _target(imp, modules)
            if target is None:
                continue
            parts = target.split(".")
            parents = [".".join(parts[:i]) for i in range(1, len(parts))]
            for dst in [target, *(p for p in parents if p in modules and not _inside(src, p))]:
                if dst != src and dst not in graph[src]:
                    graph[src][dst] = Edge(imp.line, target, via_package_init=dst != target)
    return graph, paths


def strongly_connected_components(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in a stable (sorted) order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def elementary_cycles(graph: dict[str, dict[str, Edge]], component: list[str], limit: int = 100) -> list[list[str]]:
    """Every simple cycle inside one component (each once: it starts at its smallest module)."""
    members = set(component)
    cycles: list[list[str]] = []
    for start in component:
        path, on_path = [start], {start}
        work = [iter(sorted(d for d in graph[start] if d in members and d >= start))]
        while work and len(cycles) < limit:
            nxt = next(work[-1], None)
            if nxt is None:
                work.pop()
                on_path.discard(path.pop())
            elif nxt == start:
                cycles.append([*path, start])
            elif nxt not in on_path:
                path.append(nxt)
                on_path.add(nxt)
                work.append(iter(sorted(d for d in graph[nxt] if d in members and d >= start)))
    return cycles


def _describe_cycle(cycle: list[str], graph: dict[str, dict[str, Edge]], paths: dict[str, Path]) -> str:
    lines = [" -> ".join(cycle)]
    for src, dst in itertools.pairwise(cycle):
        edge = graph[src][dst]
        how = f"imports {edge.imported}"
        if edge.via_package_init:
            how += f", which runs package {dst}'s __init__ first"
        lines.append(f"    {_rel(paths[src])}:{edge.line}: {src} {how}")
    return "\n".join(lines)


def find_cycles(root: Path, *, type_only: bool = False) -> list[str]:
    graph, paths = build_import_graph(root, type_only=type_only)
    found = []
    for component in strongly_connected_components(graph):
        if len(component) > 1:
            found += [_describe_cycle(c, graph, paths) for c in elementary_cycles(graph, component)]
    return found


# --------------------------------------------------------------------------- 1. import circles


def test_import_graph_checker_on_a_synthetic_package(tmp_path):
    """The checker itself: relative, function-local, type-only and package-init edges."""
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "a/__init__.py": "from pkg.a import x\n",  # an init importing its own submodule: fine
        "a/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import y\n",
        "a/z.py": "def f():\n    from ..b import y\n",  # function-local, relative
        "b/__init__.py": "",
        "b/y.py": "from pkg.a.x import thing\n",  # runs pkg.a's __init__ first
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    graph, _ = build_import_graph(pkg)
    assert set(graph["pkg.a"]) == {"pkg.a.x"}
    assert graph["pkg.a.x"] == {}  # type-only
    assert set(graph["pkg.a.z"]) == {"pkg.b", "pkg.b.y"}
    assert set(graph["pkg.b.y"]) == {"pkg.a", "pkg.a.x"}
    assert find_cycles(pkg) == []
    # Counted, the type-only import closes a circle: a.x -> b.y (type) -> a (init) -> a.x.
    typed, _ = build_import_graph(pkg, type_only=True)
    assert set(typed["pkg.a.x"]) == {"pkg.b", "pkg.b.y"}
    assert [c.splitlines()[0] for c in find_cycles(pkg, type_only=True)] == [
        "pkg.a -> pkg.a.x -> pkg.b.y -> pkg.a",
        "pkg.a.x -> pkg.b.y -> pkg.a.x",
    ]
    (pkg / "a/x.py").write_text("import pkg.a.z\n")  # z -> b.y -> a (init) -> x -> z
    assert [c.splitlines()[0] for c in find_cycles(pkg)] == [
        "pkg.a -> pkg.a.x -> pkg.a.z -> pkg.b.y -> pkg.a",
        "pkg.a.x -> pkg.a.z -> pkg.b.y -> pkg.a.x",
    ]


def test_no_import_cycles():
    graph, _ = build_import_graph(PACKAGE_ROOT, type_only=True)
    assert sum(map(len, graph.values())) > 50, "import graph suspiciously small; is the checker broken?"
    cycles = find_cycles(PACKAGE_ROOT, type_only=True)
    assert not cycles, f"{len(cycles)} import circle(s); break each at one of its listed imports:\n" + "\n".join(cycles)


def config_leaf_violations(root: Path) -> list[str]:
    """Imports of the config leaf's modules (config/, its sections included) that reach the rest of the package
    (type-only ones included)."""
    package = root.name
    found = []
    for path in _python_files(root / "config"):
        for imp in _imports(path, root):
            full = f"{imp.module}.{imp.name}" if imp.name else imp.module
            if _inside(full, package) and not _inside(full, f"{package}.config") and full != package:
                found.append(f"{_rel(path)}:{imp.line}: imports {full}")
    return found


def test_config_is_a_leaf():
    assert _python_files(PACKAGE_ROOT / "config"), "no config files found"
    found = config_leaf_violations(PACKAGE_ROOT)
    assert not found, (
        "config/ may import only itself (the schema knows fields, not features; a feature's section lives in "
        "config/sections/); move the check to the feature's light module and list it in the registry:\n"
        + "\n".join(found)
    )


def test_config_leaf_checker_on_a_synthetic_package(tmp_path):
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/a.py": "from pkg.config.b import X\n",
        "config/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.feature import Y\n",
        "config/sections/__init__.py": "",
        "config/sections/lora.py": "from pkg.config.a import X\nfrom pkg.lora.names import N\n",
        "feature.py": "from pkg.config.a import X\n",
        "lora/__init__.py": "",
        "lora/names.py": "",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert sorted(v.split(": ", 1)[1] for v in config_leaf_violations(pkg)) == [
        "imports pkg.feature.Y",
        "imports pkg.lora.names.N",
    ]


# Modules the pre-launch check must not load: it runs before every launch, in one process.
HEAVY_MODULES = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "torch._dynamo",
    "datasets",
    "transformers",
)

_PREFLIGHT_PROBE = """
import sys
from torchtitan.config.manager import JobConfig
from torchtitan.preflight import run_preflight
args = ["--job.config_file", "train_configs/debug_model.toml", "--training.tensor_parallel_degree", "2",
        "--experimental.pipeline_parallel_degree", "2", "--experimental.context_parallel_degree", "2",
        "--model.attn_mask_type", "block_causal", "--checkpoint.enable_checkpoint",
        "--optimizer.early_step_in_backward", "--training.max_norm", "0", "--float8.enable_float8_linear"]
run_preflight(JobConfig.parse_args(args), 16)
heavy = sys.argv[1:]
print(sorted({h for h in heavy for m in sys.modules if m == h or m.startswith(h + ".")}))
"""


def test_preflight_is_light():
    """Run the whole preflight on a config that turns on TP, PP, CP, documents, checkpoints, float8 and the
    in-backward step, in a fresh process: none of the heavy stacks gets imported."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _PREFLIGHT_PROBE, *HEAVY_MODULES],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", f"the preflight imported {out.stdout.strip()}: {out.stderr[-2000:]}"


# --------------------------------------------------------------------------- 2. file and function lengths


def _function_is_exempt(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``# declarative table`` just above the def (or its decorators) or on the def / body's first line.

    A file-level marker exempts only the file's length, not the functions in it.
    """
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    candidates = {first - 1, node.lineno - 1, *range(node.lineno, node.body[0].lineno + 1)}
    return any(1 <= n <= len(lines) and DECLARATIVE_TABLE.search(lines[n - 1]) for n in candidates)


def length_violations(root: Path) -> list[str]:
    found = []
    for path in _python_files(root):
        lines = _source(path).splitlines()
        file_exempt = any(DECLARATIVE_TABLE.search(line) for line in lines[:5])
        if len(lines) > MAX_FILE_LINES and not file_exempt:
            found.append(f"{_rel(path)}: file has {len(lines)} lines (max {MAX_FILE_LINES})")
        for node in ast.walk(_tree(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES and not _function_is_exempt(lines, node):
                found.append(f"{_rel(path)}:{node.lineno}: {node.name}() has {length} lines (max {MAX_FUNCTION_LINES})")
    return sorted(found)


def test_file_and_function_lengths():
    found = length_violations(PACKAGE_ROOT)
    assert not found, (
        f"{len(found)} over-long file(s)/function(s); split them, or mark a declarative table with a "
        "'# declarative table' comment:\n" + "\n".join(found)
    )


# --------------------------------------------------------------------------- 3. family specifics via the spec


def code_only(text: str) -> str:
    """``text`` with every comment and string literal (docstrings included) blanked out to spaces."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    chars = list(text)
    fstring_depth, fstring_start = 0, None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":  # Python >= 3.12 splits f-strings; drop them whole, like 3.11
            fstring_depth += 1
            fstring_start = fstring_start or tok.start
            continue
        if name == "FSTRING_END":
            fstring_depth -= 1
            if fstring_depth:
                continue
            span = (fstring_start, tok.end)
            fstring_start = None
        elif fstring_depth or tok.type not in (tokenize.COMMENT, tokenize.STRING):
            continue
        else:
            span = (tok.start, tok.end)
        (r0, c0), (r1, c1) = span
        for i in range(starts[r0 - 1] + c0, starts[r1 - 1] + c1):
            if chars[i] != "\n":
                chars[i] = " "
    return "".join(chars)


def _spec_only_paths() -> list[Path]:
    paths = [REPO / f for f in SPEC_ONLY_FILES]
    for folder in SPEC_ONLY_FOLDERS:
        paths += _python_files(REPO / folder)
    return paths


def _word_at(code: str, match: re.Match) -> str:
    """The whole identifier a match sits in (``moe`` -> ``moe_args``), or the match if it spans more."""
    start, end = match.span()
    if not re.fullmatch(r"\w+", match.group()):
        return " ".join(match.group().split())
    while start > 0 and (code[start - 1].isalnum() or code[start - 1] == "_"):
        start -= 1
    while end < len(code) and (code[end].isalnum() or code[end] == "_"):
        end += 1
    return code[start:end]


def family_specific_mentions(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        code = code_only(_source(path))
        hits: dict[int, set[str]] = {}
        for pattern in FAMILY_SPECIFIC:
            for match in pattern.finditer(code):
                line = code.count("\n", 0, match.start()) + 1
                hits.setdefault(line, set()).add(_word_at(code, match))
        found += [f"{_rel(path)}:{line}: {', '.join(sorted(words))}" for line, words in sorted(hits.items())]
    return found


def test_trainer_reaches_family_specifics_through_the_spec():
    paths = _spec_only_paths()
    missing = [_rel(p) for p in paths if not p.is_file()]
    assert not missing, f"files this test guards are gone; update SPEC_ONLY_FILES: {missing}"
    found = family_specific_mentions(paths)
    assert not found, (
        f"{len(found)} line(s) of trainer/metrics/validation/checkpointing code name MoE or pipeline "
        "specifics; move them behind the model spec / forward-backward function:\n" + "\n".join(found)
    )


# --------------------------------------------------------------------------- 4. models are pure modules


def _allowed_in_models(module: str) -> bool:
    top = module.split(".")[0]
    if top == "torch":
        return not _inside(module, "torch.distributed")
    if top == "torchtitan":
        return _inside(module, "torchtitan.models")
    return top == "__future__" or top in sys.stdlib_module_names


def _allowed_in_kernels(module: str) -> bool:
    """A family's ``kernels.py`` may also import an optional kernel package (flash-linear-attention's Triton
    kernels), never torch.distributed or the rest of torchtitan."""
    top = module.split(".")[0]
    return _allowed_in_models(module) or top not in ("torch", "torchtitan")


def impure_model_imports(models_root: Path) -> list[str]:
    found = []
    for path in _python_files(models_root):
        if path.name in ("spec.py", "__init__.py"):
            continue
        allowed = _allowed_in_kernels if path.name == "kernels.py" else _allowed_in_models
        for imp in _imports(path, models_root.parent):  # type-only imports count: still a dependency
            # ``from torch import distributed`` is torch.distributed; ``from torchtitan import models`` is fine.
            full = f"{imp.module}.{imp.name}" if imp.name else imp.module
            if not allowed(full):
                found.append(f"{_rel(path)}:{imp.line}: imports {full}")
    return found


def test_models_are_pure_modules():
    models_root = PACKAGE_ROOT / "models"
    assert _python_files(models_root), "no model files found"
    found = impure_model_imports(models_root)
    assert not found, (
        "models/ may import only torch (not torch.distributed), the stdlib and torchtitan.models; "
        "move the rest to the family's spec.py or to distributed/:\n" + "\n".join(found)
    )


# --------------------------------------------------------------------------- 5. the floors docs/design.md draws

DESIGN_DOC = REPO / "docs" / "design.md"
FLOORS_BEGIN = "<!-- floors: tests/unit/test_structure.py writes this block; do not edit by hand -->"
FLOORS_END = "<!-- end of floors -->"


def _unit(module: str) -> str | None:
    """The floor plan's unit of a module: a top-level file, a folder, models/ split into the pure
    modules and the families' spec.py files (the one models/ file allowed to import the rest), and each
    folder of features/ (the optional features: independent of each other, each on its own floor; the files at
    features/' top, the registry, are one unit)."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if len(parts) == 1:
        return f"{parts[0]}.py" if (PACKAGE_ROOT / f"{parts[0]}.py").is_file() else f"{parts[0]}/"
    if parts[0] == "models" and parts[-1] == "spec":
        return "models/*/spec.py"
    if parts[0] == "features" and len(parts) > 2:  # each optional feature is a unit of its own, on its own floor
        return f"features/{parts[1]}/"
    return f"{parts[0]}/"


def floor_plan(root: Path = PACKAGE_ROOT) -> tuple[dict[str, int], list[str]]:
    """(unit -> floor, units on a cycle). Floor 1 imports no other unit; each unit sits one floor above the
    highest unit it imports (type-only imports included)."""
    graph, _ = build_import_graph(root, type_only=True)
    units: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        u = _unit(src)
        if u is not None:
            # an init passed on the way that imports nothing adds no dependency (a feature's config.py is read
            # through its folder's empty init)
            reached = [d for d, edge in dsts.items() if not (edge.via_package_init and not graph[d])]
            units.setdefault(u, set()).update(d for d in map(_unit, reached) if d is not None and d != u)
    cyclic = [
        u
        for c in strongly_connected_components({u: dict.fromkeys(d) for u, d in units.items()})
        if len(c) > 1
        for u in c
    ]
    floors: dict[str, int] = {}
    remaining = {u for u in units if u not in cyclic}
    while remaining:
        ready = sorted(u for u in remaining if all(d in floors for d in units[u] if d not in cyclic))
        if not ready:
            break
        for u in ready:
            floors[u] = 1 + max((floors[d] for d in units[u] if d in floors), default=0)
        remaining -= set(ready)
    return floors, sorted(cyclic)


def _folder_unit(module: str) -> str | None:
    """The unit of the folder a module's file lies in (a family's spec.py lies in models/)."""
    parts = module.split(".")[1:]
    if len(parts) > 1 and parts[0] == "models":
        return "models/"
    return _unit(module)


def imports_running_up(root: Path = PACKAGE_ROOT) -> list[str]:
    """Imports whose target's file lies in a folder on a higher floor than the importer's unit: a unit placed apart
    from its folder (a family's spec.py) that a lower unit imports. The plan reads top-down only where there are none
    (at most ``MAX_IMPORTS_UP``)."""
    floors, _ = floor_plan(root)
    graph, paths = build_import_graph(root, type_only=True)
    found = []
    for src, dsts in graph.items():
        here = _unit(src)
        for dst, edge in dsts.items():
            there = _folder_unit(dst)
            if here is None or there is None or _unit(dst) == here or (edge.via_package_init and not graph[dst]):
                continue
            if floors.get(there, 0) > floors.get(here, 0):
                found.append(
                    f"{_rel(paths[src])}:{edge.line}: {src} (floor {floors.get(here)}) imports {dst} ({there})"
                )
    return found


MAX_IMPORTS_UP = 1


def test_few_imports_run_back_up():
    found = imports_running_up()
    assert len(found) <= MAX_IMPORTS_UP, "imports that run back up the floor plan:\n" + "\n".join(found)


def render_floor_plan(floors: dict[str, int]) -> str:
    top = max(floors.values())
    lines = [FLOORS_BEGIN, "```"]
    for f in range(top, 0, -1):
        lines.append(f"floor {f}  " + "  ".join(sorted(u for u, n in floors.items() if n == f)))
    lines += ["```", FLOORS_END]
    return "\n".join(lines)


def test_design_doc_draws_the_floors_as_they_are():
    floors, cyclic = floor_plan()
    assert not cyclic, f"these folders import each other, so they have no floor: {cyclic}"
    assert floors["config/"] == 1, f"config/ must be on the ground floor (a leaf), it is on floor {floors['config/']}"
    text = DESIGN_DOC.read_text(encoding="utf-8")
    start, end = text.find(FLOORS_BEGIN), text.find(FLOORS_END)
    assert start >= 0 and end > start, f"docs/design.md lost its floor plan block ({FLOORS_BEGIN!r})"
    drawn = text[start : end + len(FLOORS_END)]
    expected = render_floor_plan(floors)
    assert drawn == expected, "docs/design.md's floor plan is stale; replace its block with:\n" + expected


# --------------------------------------------------------------------------- 5b. the tree docs/design.md draws

TREE_BEGIN = "<!-- tree: tests/unit/test_structure.py writes this block from each package's docstring; do not edit -->"
TREE_END = "<!-- end of tree -->"


def summary_line(path: Path) -> str:
    """A module's one-line summary: its docstring's first line, which must stand alone (PEP 257)."""
    doc = ast.get_docstring(_tree(path)) or ""
    first, _, rest = doc.partition("\n")
    assert first.strip() and (not rest or rest.startswith("\n")), f"{_rel(path)}: no one-line summary in its docstring"
    return first.strip()


def render_tree(root: Path = PACKAGE_ROOT) -> str:
    """Every package of ``root`` (a folder with an ``__init__.py``) and the files at its top, each with the first line
    of its docstring."""
    rows: list[tuple[str, str]] = []

    def walk(folder: Path, depth: int) -> None:
        entries = sorted(folder.iterdir(), key=lambda p: p.name)
        if depth == 1:
            files = [p for p in entries if p.suffix == ".py" and p.name != "__init__.py"]
            rows.extend((f"  {p.name}", summary_line(p)) for p in files)
        for sub in entries:
            if sub.is_dir() and (sub / "__init__.py").is_file():
                rows.append((f"{'  ' * depth}{sub.name}/", summary_line(sub / "__init__.py")))
                walk(sub, depth + 1)

    walk(root, 1)
    width = max(len(name) for name, _ in rows) + 2
    lines = [TREE_BEGIN, "```", f"{root.name}/", *(f"{name:<{width}}{text}" for name, text in rows), "```", TREE_END]
    return "\n".join(lines)


def test_design_doc_draws_the_tree_as_it_is():
    text = DESIGN_DOC.read_text(encoding="utf-8")
    start, end = text.find(TREE_BEGIN), text.find(TREE_END)
    assert start >= 0 and end > start, f"docs/design.md lost its tree block ({TREE_BEGIN!r})"
    expected = render_tree()
    assert text[start : end + len(TREE_END)] == expected, (
        "docs/design.md's tree is stale; replace its block with:\n" + expected
    )


# --------------------------------------------------------------------------- 6. folders per concern

MAX_SIBLINGS = 12  # a file of any folder of the package sits beside at most this many entries
# Folders that hold a folder per kind of thing by design, not modules: the package's top (the entry points and the
# folders by concern) and features/ (a folder per optional feature, beside the registry).
FOLDERS_OF_FOLDERS = ("", "features")


def crowded_folders(root: Path = PACKAGE_ROOT) -> list[str]:
    """The package's folders (``FOLDERS_OF_FOLDERS`` aside) with more than ``MAX_SIBLINGS + 1`` entries
    (``__pycache__`` aside); data folders (no ``__init__.py``) too."""
    found = []
    for folder in sorted(p for p in [root, *root.rglob("*")] if p.is_dir()):
        if "__pycache__" in folder.parts or folder.relative_to(root).as_posix().strip(".") in FOLDERS_OF_FOLDERS:
            continue
        entries = [p for p in folder.iterdir() if p.name != "__pycache__"]
        if len(entries) > MAX_SIBLINGS + 1:
            found.append(f"{_rel(folder)}: {len(entries)} entries")
    return found


def test_no_crowded_folders():
    assert not crowded_folders(), "split these folders by concern (docs/design.md):\n" + "\n".join(crowded_folders())
