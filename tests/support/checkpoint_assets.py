"""The shipped old checkpoints (tests/assets/checkpoints/): what each one is, how it was written, how it is resumed.

Each asset is a run of STEPS steps that saved at RESUME_STEP and at the end; the asset keeps the RESUME_STEP folder
and the losses the run logged after it (per machine fingerprint, as tests/support/golden.py records them).
tests/runs/checkpoint/test_checkpoint_compat.py copies each into a fresh dump folder, runs the same arguments with the current code
(it resumes from that step) and compares the losses.

Write (or add a fingerprint to) the assets with ``python -m tests.support.checkpoint_assets`` (``--only NAME``,
``--record-losses`` to keep the checkpoint files and only add this machine's losses). A release keeps the
assets of the releases before it: writing new ones goes beside the old (``--release``), never over them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from tests.support.golden import cpu_model, fingerprint
from tests.support.pool import close_all, run_train_job
from tests.support.runs import ROOT, read_metrics

ASSETS_DIR = os.path.join(ROOT, "tests", "assets", "checkpoints")
INDEX = os.path.join(ASSETS_DIR, "assets.json")
STEPS, RESUME_STEP = 4, 2
DATA = "tests/assets/checkpoints/data"  # indexed corpora, tokenized with the assets' tokenizer
TOKENIZER = "tests/assets/sft/tokenizer"  # 336 words: the embedding stays small

# Every argument the writing run had, the config file first: assets.json records them, and they alone resume an asset
# to its recorded losses (docs/checkpoint.md shows the command). fp32, deterministic, seeded, every step logged.
BASE = [
    *("--job.config_file", "./train_configs/debug_model.toml"),
    *("--model.flavor", "debugmodel_nano", "--model.tokenizer_path", TOKENIZER),
    *("--training.steps", str(STEPS), "--training.seq_len", "32", "--training.batch_size", "2"),
    *("--training.warmup_steps", "2", "--optimizer.lr", "3e-3"),
    *("--training.mixed_precision_param", "float32", "--training.seed", "42", "--training.deterministic"),
    *("--activation_checkpoint.mode", "none", "--metrics.log_freq", "1"),
    *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(RESUME_STEP)),
]
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "1", "--fault_tolerance.replica_id", "0"]
# name -> (what it holds, the arguments after BASE)
ASSETS: dict[str, tuple[str, list[str]]] = {
    "dense": ("llama3, AdamW", []),
    "moe": ("llama3_moe: routed and shared experts, the expert bias buffer", ["--model.name", "llama3_moe"]),
    "lora": ("LoRA adapters only (the base comes from the seed)", ["--lora.enable", "--lora.rank", "4"]),
    "muon": (
        "Muon beside AdamW (momentum buffers), the no-decay preset",
        ["--optimizer.name", "Muon", "--optimizer.no_decay", "norm,bias,embedding"],
    ),
    "ft": (
        "fault tolerance: one replica group with DiLoCo (the outer optimizer's state, per-group folders)",
        [*FT, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"],
    ),
    "indexed": (
        "a blend of two Megatron indexed corpora (the loader's per-source positions)",
        ["--training.dataset_mix", f"{DATA}/docs:0.7,{DATA}/arith:0.3"],
    ),
}


def asset_folder(name: str) -> str:
    return os.path.join(ASSETS_DIR, name, f"step-{RESUME_STEP}")


def argv(name: str) -> list[str]:
    """The trainer's complete arguments for asset ``name``, but the dump folder."""
    return [*BASE, *ASSETS[name][1]]


def checkpoint_root(name: str, folder: str) -> str:
    """Where a run of asset ``name`` in dump folder ``folder`` keeps its checkpoints (a replica group its own)."""
    return os.path.join(folder, "checkpoint", *(["replica_0"] if name == "ft" else []))


def run_folder(name: str, folder: str) -> str:
    """Where that run writes metrics.jsonl and rank0.log."""
    return os.path.join(folder, "replica_0") if name == "ft" else folder


def run(name: str, folder: str) -> str | None:
    """Asset ``name``'s run in dump folder ``folder`` (the worker pool; the ft one beside a lighthouse of its own);
    None, or its error."""
    if name != "ft":
        status = run_train_job(1, [*argv(name), "--job.dump_folder", folder])
        return None if status["ok"] else status["error"][-3000:]
    from tests.support.ft_groups import FtJob

    with FtJob(1, 1, min_replicas=1) as job:
        failed = [r.error for r in job.run([[*argv(name), "--job.dump_folder", folder]])[0] if r is not None]
    return failed[0] if failed else None


def read_index() -> dict:
    if not os.path.isfile(INDEX):
        return {"assets": {}}
    with open(INDEX, encoding="utf-8") as f:
        return json.load(f)


def losses_after(folder: str, step: int) -> dict[str, float]:
    """The losses a run in ``folder`` logged after ``step`` (metrics.jsonl), keyed by the step as a string."""
    return {str(r["step"]): r["loss"] for r in read_metrics(folder) if "loss" in r and r["step"] > step}


def _write_data() -> None:
    """Two small indexed corpora: docs (the first 40 pydocs texts) and arithmetic sentences."""
    from torchtitan.datasets.indexed.tokenize import tokenize_to_indexed

    os.makedirs(os.path.join(ROOT, DATA), exist_ok=True)
    with open(os.path.join(ROOT, "torchtitan/datasets/assets/pydocs/pydocs.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"][:2000] for _, line in zip(range(40), f)]
    arith = [f"{a} plus {b} is {a + b}. {a} times {b} is {a * b}." for a in range(12) for b in range(12)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, texts in (("docs", docs), ("arith", arith)):
            source = os.path.join(tmp, f"{name}.jsonl")
            with open(source, "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
            tokenize_to_indexed(source, os.path.join(ROOT, DATA, name), os.path.join(ROOT, TOKENIZER))


def write(name: str, index: dict, *, record_only: bool) -> None:
    """Run asset ``name``'s arguments, keep its RESUME_STEP checkpoint (unless ``record_only``) and this machine's
    losses after it."""
    with tempfile.TemporaryDirectory() as tmp:
        error = run(name, tmp)
        if error is not None:
            sys.exit(f"asset {name}: the run failed:\n{error}")
        entry = index["assets"].setdefault(name, {"holds": ASSETS[name][0], "argv": argv(name), "losses": {}})
        if not record_only:
            shutil.rmtree(os.path.dirname(asset_folder(name)), ignore_errors=True)
            shutil.copytree(os.path.join(checkpoint_root(name, tmp), f"step-{RESUME_STEP}"), asset_folder(name))
            entry.update(holds=ASSETS[name][0], argv=argv(name), losses={})
        entry["losses"][fingerprint()] = losses_after(run_folder(name, tmp), RESUME_STEP)
        print(f"{name}: {entry['losses'][fingerprint()]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(ASSETS), help="these assets (default: all)")
    parser.add_argument("--record-losses", action="store_true", help="keep the files; add this machine's losses")
    args = parser.parse_args()
    index = read_index()
    if not args.record_losses and not os.path.isfile(os.path.join(ROOT, DATA, "docs.idx")):
        _write_data()
    try:
        for name in args.only or sorted(ASSETS):
            write(name, index, record_only=args.record_losses)
    finally:
        close_all()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    index.setdefault("machines", {})[fingerprint()] = cpu_model()
    if not args.record_losses:
        from torchtitan.checkpointing.files.format import FORMAT_VERSION, release

        index.update(format=FORMAT_VERSION, release=release(), written_at_commit=commit.stdout.strip())
    with open(INDEX, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
