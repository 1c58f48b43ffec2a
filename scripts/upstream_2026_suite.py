"""Run upstream torchtitan 2026's ``features`` integration suite here: each enabled configuration through
run_llama_train.sh (``--module torchtitan_recipes.tests.features --config F``) at its GPU count as CPU processes.

    python scripts/upstream_2026_suite.py                       # the pinned copy in tests/assets/torchtitan_2026
    python scripts/upstream_2026_suite.py --mirror REPO.git      # upstream's files at that git dir's HEAD instead
    python scripts/upstream_2026_suite.py --only default sft     # some entries (upstream's test_name)

Upstream's files are copied into a scratch folder (``--work``) and imported from there, unchanged. Each
configuration trains ``--steps`` steps; the flags on top only make it small and local: ``--training.seq_len``
(upstream's 2048 -> 128), the shipped data and tokenizer instead of upstream's ``c4_test`` and
``./tests/assets/tokenizer`` (chat data for the SFT entry), the dump folder, and the steps. The configurations of
a save -> load entry share a dump folder and each runs ``--steps`` more than the one before, so the load resumes;
a load from Hugging Face weights is pointed at what the entry's save wrote. Each run ends ``trains`` (exit 0 and
its steps in metrics.jsonl), ``refused`` (exit 2, one line), or ``FAILED`` (anything else: the script exits 1).
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINNED = os.path.join(ROOT, "tests", "assets", "torchtitan_2026")
RECIPE_FILES = ("torchtitan_recipes/__init__.py", "torchtitan_recipes/tests/__init__.py",
                "torchtitan_recipes/tests/features.py")  # fmt: skip
SUITE = "tests/integration_tests/features.py"  # upstream's list: configurations, GPU counts, enabled flags
MODULE = "torchtitan_recipes.tests.features"
TOKENIZER = os.path.join(ROOT, "torchtitan", "datasets", "assets", "tokenizer", "pydocs_bpe2048.tiktoken")
SFT = os.path.join(ROOT, "tests", "assets", "sft")


class Entry(NamedTuple):
    name: str  # upstream's test_name
    configs: tuple[str, ...]
    ngpu: int
    disabled: bool


def read_suite(source: str) -> list[Entry]:
    """Upstream's ``build_features_test_list`` read without importing it (it imports upstream's test harness)."""
    entries = []
    for call in ast.walk(ast.parse(source)):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "OverrideDefinitions":
            kw = {k.arg: k.value for k in call.keywords}
            configs = tuple(e.attr for e in kw["configs"].elts)
            ngpu = ast.literal_eval(kw["ngpu"]) if "ngpu" in kw else 4  # OverrideDefinitions' default
            disabled = ast.literal_eval(kw["disabled"]) if "disabled" in kw else False
            entries.append(Entry(ast.literal_eval(kw["test_name"]), configs, ngpu, disabled))
    return entries


def copy_files(work: str, mirror: str | None) -> str:
    """Upstream's recipe package into ``work``; returns the suite list's text."""
    for path in RECIPE_FILES:
        os.makedirs(os.path.join(work, os.path.dirname(path)), exist_ok=True)
        if mirror:
            text = subprocess.run(["git", "-C", mirror, "show", f"HEAD:{path}"], check=True, capture_output=True).stdout
            with open(os.path.join(work, path), "wb") as f:
                f.write(text)
        else:
            shutil.copyfile(os.path.join(PINNED, path), os.path.join(work, path))
    if mirror:
        return subprocess.run(
            ["git", "-C", mirror, "show", f"HEAD:{SUITE}"], check=True, capture_output=True, text=True
        ).stdout
    with open(os.path.join(PINNED, "integration_tests", "features.py")) as f:
        return f.read()


def flags(config: str, folder: str, steps: int, seq_len: int) -> list[str]:
    data = ["--training.dataset", "pydocs", "--model.tokenizer_path", TOKENIZER, "--validation.dataset", "pydocs_val"]
    if config.endswith("_sft"):  # upstream's chat rows (tests/assets/sft_test) -> the shipped chat rows
        data = ["--training.dataset", "sft_arith", "--training.dataset_path", os.path.join(SFT, "arith_train.jsonl"),
                "--model.tokenizer_path", os.path.join(SFT, "tokenizer")]  # fmt: skip
    return [*data, "--training.seq_len", str(seq_len), "--training.steps", str(steps), "--job.dump_folder", folder]


def hf_export(folder: str) -> list[str]:
    """A Hugging Face export an earlier configuration of the entry wrote (its safetensors folder)."""
    found = sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True))
    return ["--checkpoint.initial_load_path", os.path.dirname(found[-1])] if found else []


def logged_steps(folder: str) -> list[int]:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r["step"] for r in map(json.loads, f) if "loss" in r]


def run_one(entry: Entry, index: int, config: str, work: str, steps: int, seq_len: int) -> tuple[str, str, float]:
    shared = os.path.join(work, "outputs", entry.name)
    from_hf = "hf_checkpoint_load" in config  # a fresh run from the weights an earlier one exported
    resumes = any("load" in c for c in entry.configs) and not from_hf  # save -> load: one folder, as upstream's runner
    folder = shared if resumes else f"{shared}.{config}"
    total = steps * (index + 1) if resumes else steps
    argv = ["--module", MODULE, "--config", config, *flags(config, folder, total, seq_len)]
    if from_hf:
        argv += hf_export(shared)
    env = dict(os.environ, NGPU=str(entry.ngpu), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # inductor's code cache of this suite only: a graph cached by another run's layout names process groups by that
    # run's numbering ("Could not resolve the process group registered under the name 4" on a hit)
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(work, "inductor_cache")
    before = len(logged_steps(folder))
    start = time.monotonic()
    proc = subprocess.run([os.path.join(ROOT, "run_llama_train.sh"), *argv], cwd=work, env=env,
                          capture_output=True, text=True)  # fmt: skip
    seconds = time.monotonic() - start
    with open(os.path.join(work, f"{entry.name}.{config}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    if proc.returncode == 0:
        done = logged_steps(folder)[before:]
        if done and done[-1] == total:
            return "trains", f"steps {done[0]}..{done[-1]}", seconds
        if config.endswith("seed_checkpoint"):
            return "trains", "seed checkpoint written (upstream's run trains no step either)", seconds
        return "FAILED", f"exit 0 but logged steps {done}", seconds
    if proc.returncode == 2 and lines and "Traceback" not in proc.stderr:
        return "refused", lines[-1], seconds
    return "FAILED", f"exit {proc.returncode}: {lines[-1] if lines else ''}", seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mirror", help="a git dir of pytorch/torchtitan: take its HEAD's files (default: the pinned copy)")
    p.add_argument("--work", default=os.path.join(ROOT, "outputs", "upstream_2026_suite"), help="scratch folder")
    p.add_argument("--only", nargs="*", help="entries to run (upstream's test_name); default: every enabled one")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=128)
    args = p.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    entries = [e for e in read_suite(copy_files(args.work, args.mirror)) if not e.disabled]
    if args.only:
        unknown = sorted(set(args.only) - {e.name for e in entries})
        if unknown:
            p.error(f"--only {' '.join(unknown)}: not an enabled entry; enabled: {', '.join(e.name for e in entries)}")
        entries = [e for e in entries if e.name in args.only]
    counts: dict[str, int] = {}
    total = time.monotonic()
    print("| entry | configuration | ranks | here | seconds | detail |\n|---|---|---|---|---|---|", flush=True)
    for entry in entries:
        for i, config in enumerate(entry.configs):
            outcome, detail, seconds = run_one(entry, i, config, args.work, args.steps, args.seq_len)
            counts[outcome] = counts.get(outcome, 0) + 1
            print(f"| {entry.name} | `{config}` | {entry.ngpu} | {outcome} | {seconds:.0f} | {detail} |", flush=True)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"\n{summary}; {time.monotonic() - total:.0f} s", flush=True)
    return 1 if counts.get("FAILED") else 0


if __name__ == "__main__":
    sys.exit(main())
