#!/usr/bin/env python3
"""Folders per concern ("One house, second plan", part 4): move torchtitan's modules and rewrite every reference.

    python apply_moves.py REPO_ROOT [--python /work/venv/bin/python]

Works from MODULE_MAP (old dotted module -> new dotted module) and regexes, not from a list of files, so it
runs on a tree it has never seen. For each entry whose source exists it ``git mv``s the file, creating the
new packages (``__init__.py``: one docstring line, PACKAGE_DOCS) on the way; an entry whose source is gone is
skipped with a note (already moved: its references are still rewritten). Then, in every text file under
SCAN (.py .md .toml .sh .cfg .txt .slurm, and .ci/run) it rewrites:

* ``from X import a, b`` where ``X.a`` is a moved module -> ``from NEWPARENT import NEWNAME as a``;
* dotted names (``import x.y``, ``from x.y import z``, ``"x.y:fn"`` Deferred specs, ``python -m x.y``,
  mock/patch strings ``"x.y.attr"``, ``importlib.import_module("x.y")``), also without the ``torchtitan.``
  prefix (``distributed.pipeline.prune_to_stage`` in prose);
* file paths (``torchtitan/distributed/pipeline.py``, ``distributed/pipeline.py``, a bare
  ``pipeline_layout.py`` when no other file has that name).

Idempotent: a name already under its new package is left alone, so a second run changes nothing. Then
``ruff check --fix`` and ``ruff format`` (import order), the floor plan block of docs/design.md redrawn
with tests/unit/test_structure.py's own functions, the folder sizes checked, and a summary printed.
Stdlib only.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

P = "torchtitan."
# old -> new, dotted (``torchtitan.`` implied).  # declarative table
MODULE_MAP: list[tuple[str, str]] = [
    # distributed/tensor_parallel/
    ("distributed.tensor_parallel", "distributed.tensor_parallel.plan"),
    ("distributed.async_tp", "distributed.tensor_parallel.async_tp"),
    ("distributed.async_tp_float8", "distributed.tensor_parallel.async_tp_float8"),
    ("distributed.async_tp_ring", "distributed.tensor_parallel.async_tp_ring"),
    ("distributed.tp_checks", "distributed.tensor_parallel.checks"),
    # distributed/context_parallel/
    ("distributed.context_parallel", "distributed.context_parallel.context_parallel"),
    ("distributed.torch_context_parallel", "distributed.context_parallel.torch_context_parallel"),
    ("distributed.ring_attention_math", "distributed.context_parallel.ring_attention_math"),
    ("distributed.ring_attention_plans", "distributed.context_parallel.ring_attention_plans"),
    ("distributed.ring_comms", "distributed.context_parallel.ring_comms"),
    ("distributed.cp_checks", "distributed.context_parallel.checks"),
    # distributed/pipeline/
    ("distributed.pipeline", "distributed.pipeline.stages"),
    ("distributed.pipeline_layout", "distributed.pipeline.layout"),
    # distributed/expert_parallel/
    ("distributed.expert_parallel", "distributed.expert_parallel.experts"),
    # global-batch MoE balance: parallelize (distributed/) applies it, so it stays below features/
    ("distributed.moe_balance", "distributed.expert_parallel.moe_balance"),
    # distributed/backend/
    ("distributed.c10d_compat", "distributed.backend.c10d_compat"),
    ("distributed.device", "distributed.backend.device"),
    ("distributed.dtensor", "distributed.backend.dtensor"),
    # LoRA's TP styles: beside the TP plan that picks them (lora/ imports distributed/, so not in lora/)
    ("distributed.lora_tp", "distributed.tensor_parallel.lora"),
    # components/optim/
    ("components.optimizer", "components.optim.optimizer"),
    ("components.lr_schedule", "components.optim.lr_schedule"),
    ("components.muon", "components.optim.muon"),
    ("components.muon_round_robin", "components.optim.muon_round_robin"),
    ("components.optim_lowp", "components.optim.optim_lowp"),
    ("components.param_groups", "components.optim.param_groups"),
    # components/: the memory options' pre-launch check
    ("components.memory_checks", "components.checks"),
    # features/: one folder per optional feature, each its own floor-plan unit (tests/unit/test_structure.py):
    # the document feed and in-backward sit below components/ (the step imports them), step replay and validation
    # above it (they run the step)
    ("components.replay", "features.replay.replay"),
    ("components.replay_checks", "features.replay.checks"),
    ("components.validation", "features.validation.validation"),
    ("components.float8", "features.float8.float8"),
    ("components.document_feed", "features.documents.feed"),
    ("components.attention_checks", "features.documents.checks"),
    ("components.load_balancing", "features.moe_balance.load_balancing"),
    ("observability.stragglers", "features.stragglers.stragglers"),
    ("components.optimizer_in_backward", "features.in_backward.in_backward"),
    ("components.in_backward_checks", "features.in_backward.checks"),
    # datasets/: load-time file checks are not a pre-launch check (checks.py is)
    ("datasets.file_checks", "datasets.local_files"),
]
MODULE_MAP = [(P + old, P + new) for old, new in MODULE_MAP]

PACKAGE_DOCS = {  # new package -> its __init__'s one-line docstring
    "distributed.tensor_parallel": "Tensor parallel: the plans (sequence and loss parallel, LoRA's styles), async TP, checks.",
    "distributed.context_parallel": "Context parallel: sequence sharding, ring attention (ours and torch's) and its checks.",
    "distributed.pipeline": "Pipeline parallel: the stage layout, the stages and their schedule.",
    "distributed.expert_parallel": "Expert parallel (experts sharded over the EP mesh) and global-batch MoE balance.",
    "distributed.backend": "The device, the process-group backend and torch-version seams (c10d, DTensor helpers).",
    "components.optim": "Optimizers and learning-rate schedules: AdamW, Muon, low-precision states, parameter groups.",
    "features": "Optional features, one folder each (its config's code, pre-launch check and build); imports nothing.",
    "features.replay": "Step replay: re-run a step and compare (silent data corruption), and its pre-launch check.",
    "features.validation": "Validation: the held-out loss every validation.freq steps (the after_step seam).",
    "features.float8": "Float8 training with torchao: conversion, checks and the FSDP scale precompute.",
    "features.documents": "Document masking (block_causal): the trainer's document feed and its pre-launch check.",
    "features.moe_balance": "MoE load balancing: the expert-load tracker, the aux loss and the expert-bias update.",
    "features.stragglers": "Straggler detection: ranks whose steps run slower than the others.",
    "features.in_backward": "The optimizer step in backward (per-parameter, freeing gradients early) and its check.",
}
PACKAGE_DOCS = {P + k: v for k, v in PACKAGE_DOCS.items()}

SCAN_DIRS = ("torchtitan", "tests", "scripts", "bench", "docs", "train_configs", ".ci")
SCAN_FILES = ("README.md", "estimation.py", "pyproject.toml", "run_llama_train.sh")
SUFFIXES = (".py", ".md", ".toml", ".sh", ".cfg", ".txt", ".slurm")
SKIP_PARTS = {".git", "__pycache__", ".venv", "venv", ".whl", "node_modules", ".ruff_cache", ".pytest_cache"}
# Folders whose entries (files and subfolders, __pycache__ aside) must stay at most 13: no file beside more than 12.
SIZE_CHECKED = ("torchtitan/distributed", "torchtitan/components")
MAX_ENTRIES = 13


def mod_path(root: Path, module: str) -> Path:
    return root / (module.replace(".", "/") + ".py")


def rel(module: str) -> str:
    """``torchtitan.distributed.pipeline`` -> ``distributed/pipeline.py`` (relative to the package)."""
    return module[len(P) :].replace(".", "/") + ".py"


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True)


# ----------------------------------------------------------------------------------------------- moving files


def ensure_package(root: Path, package: str, notes: list[str]) -> None:
    """Create ``package`` and its parents up to ``torchtitan`` with a one-line ``__init__.py`` each."""
    parts = package.split(".")
    for i in range(2, len(parts) + 1):
        pkg = ".".join(parts[:i])
        init = root / pkg.replace(".", "/") / "__init__.py"
        if init.exists():
            continue
        doc = PACKAGE_DOCS.get(pkg, f"{parts[i - 1].replace('_', ' ').capitalize()}.")
        init.parent.mkdir(parents=True, exist_ok=True)
        init.write_text(f'"""{doc}"""\n')
        git(root, "add", str(init.relative_to(root)))
        notes.append(f"created {init.relative_to(root)}")


def move_files(root: Path) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """``git mv`` each entry; (the entries whose references to rewrite, what moved, notes)."""
    effective, moved, notes = [], [], []
    for old, new in MODULE_MAP:
        src, dst = mod_path(root, old), mod_path(root, new)
        if src.is_file() and dst.exists():
            notes.append(f"skipped {rel(old)}: {rel(new)} exists already; merge them by hand")
            continue
        if not src.is_file():
            if dst.is_file():
                ensure_package(root, new.rpartition(".")[0], notes)  # someone moved it without an __init__.py
                effective.append((old, new))
                notes.append(f"already moved: {rel(old)} -> {rel(new)}")
            else:
                notes.append(
                    f"skipped {rel(old)}: no such file (removed or moved elsewhere); references left as they are"
                )
            continue
        ensure_package(root, new.rpartition(".")[0], notes)
        git(root, "mv", str(src.relative_to(root)), str(dst.relative_to(root)))
        effective.append((old, new))
        moved.append(f"{rel(old)} -> {rel(new)}")
    return effective, moved, notes


# ----------------------------------------------------------------------------------------------- rewriting


class Rewriter:
    """Rewrites module names and paths in text, for the effective moves."""

    def __init__(self, root: Path, moves: list[tuple[str, str]]):
        self.old_to_new = dict(moves)
        self.new_names = set()  # every new module and package: a name under one is already rewritten
        for new in self.old_to_new.values():
            parts = new.split(".")
            self.new_names.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        self.roots = {old.split(".")[1] for old in self.old_to_new}  # short forms: distributed.x, components.x
        self.paths = {}  # old relative path forms -> new ones
        basenames = self._basenames(root)
        for old, new in moves:
            self.paths[rel(old)] = rel(new)
            name = rel(old).rsplit("/", 1)[-1]
            if basenames.get(name, 0) == 0:  # unique: no file of that name is left in the tree
                self.paths[name] = rel(new).split("/", 1)[1] if rel(old).count("/") else rel(new)
        self.pattern = re.compile(
            r"(?P<from>^[ \t]*from[ \t]+(?P<mod>[\w.]+)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^\n#]*[^\s#]))"
            r"|(?P<path>(?<![\w./-])[\w./-]*\w\.py\b)"
            r"|(?P<dotted>(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)",
            re.MULTILINE,
        )

    @staticmethod
    def _basenames(root: Path) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in SKIP_PARTS]
            for f in filenames:
                if f.endswith(".py"):
                    counts[f] = counts.get(f, 0) + 1
        return counts

    # -- names

    def resolve(self, full: str) -> str | None:
        """The new name of a dotted ``torchtitan.`` name, or None when it names nothing moved (or is new already)."""
        parts = full.split(".")
        for i in range(len(parts), 1, -1):
            head = ".".join(parts[:i])
            if head in self.old_to_new:
                # already rewritten: a longer prefix names a new module (torchtitan.distributed.pipeline.stages)
                if any(".".join(parts[:j]) in self.new_names for j in range(i + 1, len(parts) + 1)):
                    return None
                return ".".join([self.old_to_new[head], *parts[i:]])
        return None

    def dotted(self, token: str) -> str:
        if token.startswith(P):
            return self.resolve(token) or token
        if token.split(".", 1)[0] in self.roots:
            new = self.resolve(P + token)
            return new[len(P) :] if new else token
        return token

    def from_import(self, match: re.Match) -> str:
        indent = match.group("from")[: len(match.group("from")) - len(match.group("from").lstrip())]
        mod, names = match.group("mod"), match.group("names")
        body = names.strip()[1:-1] if names.strip().startswith("(") else names
        if "#" in body or "\\" in body or "*" in body:
            return match.group("from").replace(mod, self.dotted(mod), 1)  # unusual form: the module only
        items = [n.strip() for n in body.split(",") if n.strip()]
        keep, statements, moved, already_new = [], [], False, False
        for item in items:
            name, _, alias = (part.strip() for part in item.partition(" as "))
            full = f"{mod}.{name}" if mod.startswith(P) or mod == "torchtitan" else None
            new = self.old_to_new.get(full) if full else None
            if new is not None:  # ``from pkg import moved_module``
                parent, _, base = new.rpartition(".")
                local = alias or name
                statements.append(f"{indent}from {parent} import {base}" + (f" as {local}" if local != base else ""))
                moved = True
            elif full is not None and full in self.new_names:  # ``from new_pkg import new_module``: as it is
                statements.append(f"{indent}from {mod} import {item}")
                already_new = True
            else:
                keep.append(item)
        if not moved:  # no imported name is a moved module: only the module named may change
            new_mod = mod if already_new else self.dotted(mod)
            return match.group("from") if new_mod == mod else match.group("from").replace(mod, new_mod, 1)
        if keep:
            statements.insert(0, f"{indent}from {self.dotted(mod)} import {', '.join(keep)}")
        return "\n".join(statements)

    # -- paths

    def path(self, token: str) -> str:
        lead = "./" if token.startswith("./") else ""
        body = token[len(lead) :]
        for prefix in ("torchtitan/", ""):
            if body.startswith(prefix) and body[len(prefix) :] in self.paths:
                return lead + prefix + self.paths[body[len(prefix) :]]
        marker = "/torchtitan/"
        if marker in body:  # an absolute path into a checkout
            head, _, tail = body.rpartition(marker)
            if tail in self.paths and "/" in tail:
                return lead + head + marker + self.paths[tail]
        return token

    def __call__(self, text: str) -> str:
        def one(match: re.Match) -> str:
            if match.group("from") is not None:
                return self.from_import(match)
            if match.group("path") is not None:
                return self.path(match.group("path"))
            return self.dotted(match.group("dotted"))

        return self.pattern.sub(one, text)


def text_files(root: Path) -> list[Path]:
    found = [root / f for f in SCAN_FILES if (root / f).is_file()]
    for top in SCAN_DIRS:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = [d for d in dirnames if d not in SKIP_PARTS]
            for f in filenames:
                path = Path(dirpath) / f
                if f.endswith(SUFFIXES) or path.relative_to(root).as_posix() == ".ci/run":
                    found.append(path)
    return sorted(set(found))


def rewrite_tree(root: Path, rewriter: Rewriter) -> list[str]:
    changed = []
    for path in text_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        new = rewriter(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path.relative_to(root).as_posix())
    return changed


# ----------------------------------------------------------------------------------------------- afterwards


def run_ruff(root: Path, python: str) -> list[str]:
    out = []
    for args in (["check", "--fix", "--quiet", "."], ["format", "--quiet", "."]):
        proc = subprocess.run([python, "-m", "ruff", *args], cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            out.append(f"ruff {args[0]} exited {proc.returncode}:\n{(proc.stdout + proc.stderr).strip()[-3000:]}")
    return out


def redraw_floors(root: Path) -> str:
    """The floor plan block of docs/design.md, computed by tests/unit/test_structure.py's own functions."""
    test = root / "tests/unit/test_structure.py"
    design = root / "docs/design.md"
    if not test.is_file() or not design.is_file():
        return "floors: tests/unit/test_structure.py or docs/design.md missing; not redrawn"
    spec = importlib.util.spec_from_file_location("_structure_for_moves", test)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    floors, cyclic = module.floor_plan(root / "torchtitan")
    if cyclic:
        return f"floors: NOT redrawn, these folders import each other: {cyclic}"
    text = design.read_text(encoding="utf-8")
    start, end = text.find(module.FLOORS_BEGIN), text.find(module.FLOORS_END)
    if start < 0 or end < start:
        return "floors: docs/design.md has no floor block; not redrawn"
    block = module.render_floor_plan(floors)
    new = text[:start] + block + text[end + len(module.FLOORS_END) :]
    if new != text:
        design.write_text(new, encoding="utf-8")
        return "floors: docs/design.md's block redrawn:\n" + block
    return "floors: docs/design.md's block unchanged"


DESIGN_TREE_OLD = """\
  distributed/        ParallelDims and the world mesh (mesh.py: groups by axis), device/backend, one file
                      per transform: parallelize (the order), fsdp, tensor_parallel, async_tp (+ its
                      ring plumbing async_tp_ring and float8 GEMMs async_tp_float8),
                      context_parallel, torch_context_parallel, pipeline (+ pipeline_layout),
                      expert_parallel, activation_checkpoint, grad_norm, init
  components/         step (the one forward/loss/backward path), loss (incl. chunked), optimizer (the
                      config's settings applied on resume), lr_schedule (ours and torchtitan 2025's), optim_lowp (bf16 states),
                      validation, load_balancing (MoE expert load), run_control (the per-step
                      agreement: non-finite guard and stop signals), float8 (torchao conversion, its
                      checks, the FSDP scale precompute hook)
"""
DESIGN_TREE_NEW = """\
  distributed/        ParallelDims and the world mesh (mesh.py: groups by axis), parallelize (the order), fsdp,
                      activation_checkpoint, grad_norm, init; one folder per parallelism: tensor_parallel/
                      (plan, lora: LoRA's styles, async_tp + its ring plumbing async_tp_ring and float8 GEMMs
                      async_tp_float8, checks), context_parallel/ (ours: context_parallel over
                      ring_attention_plans, ring_attention_math and ring_comms; torch_context_parallel;
                      checks), pipeline/ (layout, stages), expert_parallel/ (experts; moe_balance: global-batch
                      balance statistics); backend/ (device and process-group backend, c10d_compat, dtensor)
  components/         step (the one forward/loss/backward path), loss (incl. chunked), optim/ (optimizer: the
                      config's settings applied on resume; lr_schedule: ours and torchtitan 2025's; muon,
                      muon_round_robin; optim_lowp: bf16 states; param_groups), validation, run_control (the
                      per-step agreement: non-finite guard and stop signals), replay/ (step replay, checks),
                      generation, checks (the memory options)
  features/           one folder per optional feature, its pre-launch check in checks.py beside it: float8/
                      (torchao conversion, its checks, the FSDP scale precompute hook), documents/ (feed:
                      block_causal's documents to every forward; checks), moe_balance/ (load_balancing: MoE
                      expert load, aux loss, bias update), in_backward/ (the optimizer step in backward;
                      checks), stragglers/ (slow ranks)
"""


PROSE_EDITS = [  # (file, old text, new text): the package trees that list folders
    ("docs/design.md", DESIGN_TREE_OLD, DESIGN_TREE_NEW),
    ("README.md", "distributed/, components/, observability/", "distributed/, components/, features/, observability/"),
]


def update_prose(root: Path) -> list[str]:
    """The package trees of docs/design.md and README.md: each edit applied once, or a note to do it by hand."""
    out = []
    for name, old, new in PROSE_EDITS:
        path = root / name
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        if new in text:
            out.append(f"{name}: package tree up to date")
        elif old in text:
            path.write_text(text.replace(old, new, 1), encoding="utf-8")
            out.append(f"{name}: package tree updated (features/ and the new folders)")
        else:
            out.append(f"{name}: package tree NOT updated (its text changed): add the new folders by hand")
    return out


def leftover_names(root: Path, moves: list[tuple[str, str]]) -> list[str]:
    """Lines that still name a moved module by its old file name alone (``cp_checks.check_x`` in prose): by hand."""
    taken = {part for _, new in moves for part in new.split(".")}
    taken |= {f[:-3] for _, _, files in os.walk(root / "torchtitan") for f in files if f.endswith(".py")}
    stems = sorted({old.rsplit(".", 1)[1] for old, _ in moves} - taken)
    if not stems:
        return []
    word = re.compile(r"(?<![\w/])(" + "|".join(map(re.escape, stems)) + r")(?![\w/])")
    found = []
    for path in text_files(root):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(lines, 1):
            if word.search(line):
                found.append(f"{path.relative_to(root)}:{i}: {line.strip()[:140]}")
    return found


def folder_sizes(root: Path) -> list[str]:
    too_big = []
    for top in SIZE_CHECKED:
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            entries = len(dirnames) + len(filenames)
            if entries > MAX_ENTRIES:
                too_big.append(f"{Path(dirpath).relative_to(root)}: {entries} entries (max {MAX_ENTRIES})")
    return too_big


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="the repository root (a git checkout)")
    parser.add_argument("--python", default="/work/venv/bin/python", help="a python with ruff installed")
    parser.add_argument("--no-ruff", action="store_true", help="skip ruff check --fix / format")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / ".git").exists() or not (root / "torchtitan").is_dir():
        print(f"error: {root} is not a torchtitan checkout", file=sys.stderr)
        return 2
    effective, moved, notes = move_files(root)
    rewriter = Rewriter(root, effective)
    changed = rewrite_tree(root, rewriter)
    extra = [] if args.no_ruff else run_ruff(root, args.python)
    tree = update_prose(root)
    floors = redraw_floors(root)
    too_big = folder_sizes(root)
    leftovers = leftover_names(root, effective)
    print(f"moved {len(moved)} file(s):")
    print("".join(f"  {m}\n" for m in moved), end="")
    print(f"notes ({len(notes)}):")
    print("".join(f"  {n}\n" for n in notes), end="")
    print(f"rewrote references in {len(changed)} file(s):")
    print("".join(f"  {c}\n" for c in changed), end="")
    for line in extra:
        print(line)
    print("\n".join(tree))
    print(floors)
    print(f"old file names still in the text ({len(leftovers)}; prose, check by hand):")
    print("".join(f"  {line}\n" for line in leftovers), end="")
    print("folder sizes: " + ("ok" if not too_big else "TOO BIG:\n  " + "\n  ".join(too_big)))
    return 1 if extra or too_big or "NOT redrawn" in floors else 0


if __name__ == "__main__":
    sys.exit(main())
