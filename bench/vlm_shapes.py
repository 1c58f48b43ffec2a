"""Image-text fine-tuning that learns: held-out exact match on the synthetic shapes task, before and after.

1. **The task** (scripts/build_vlm_assets.py, into ``--dump_folder``): 48x48 pictures of one coloured shape; chat rows
   asking "What colour is the shape?" or "What shape is it?" (one word answers; one train row in ten asks about the
   second of two images); the validation rows' pictures are new draws. Chance: 1/4 for a colour, 1/3 for a shape.
2. **Fine-tune**: ``python -m torchtitan.train`` (one process) on train_configs/qwen3_5_vl_shapes.toml (qwen3_5_vl
   debugmodel from random init: the debug hybrid and a 2-block tower), packed windows with block_causal documents,
   the loss on the answer; a checkpoint at the last step.
3. **Score**: every held-out row, the model at its initial weights (the run's seed) and at the last checkpoint. Exact
   match: every answer token and the end of turn are the greedy picks given the question (teacher forcing: with all
   of them right, greedy decoding writes exactly the answer), by question kind, with chance beside it.
4. **The CLI**: ``scripts/generate.py CKPT --chat --image PNG --prompt "What colour is the shape?"`` once, as a
   subprocess; its printed answer and the expected one are in the JSON.

Prints one JSON object (train time = the trainer subprocess's wall time, start-up included).

    python -m bench.vlm_shapes [--steps 300] [--lr 1e-3] [--batch_size 8] [--dump_folder /tmp/torchtitan_bench_vlm]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parent.parent
CONFIG = "train_configs/qwen3_5_vl_shapes.toml"
CHANCE = {"colour": 0.25, "shape": 1 / 3}


def build_task(folder: Path, train: int, val: int) -> Path:
    spec = importlib.util.spec_from_file_location("build_vlm_assets", REPO / "scripts" / "build_vlm_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(str(folder), train=train, val=val)


def flags(args: argparse.Namespace, task: Path, run: Path) -> list[str]:
    return [
        *("--job.config_file", CONFIG, "--job.dump_folder", str(run), "--training.steps", str(args.steps)),
        *(
            "--model.tokenizer_path",
            str(task / "tokenizer"),
            "--training.dataset_path",
            str(task / "shapes_train.jsonl"),
        ),
        *("--validation.dataset_path", str(task / "shapes_val.jsonl"), "--validation.freq", str(args.steps)),
        *("--optimizer.lr", str(args.lr), "--training.batch_size", str(args.batch_size)),
        *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(args.steps), "--metrics.log_freq", "25"),
    ]


def model_and_rows(argv: list[str], task: Path):
    """The run's model at its initial weights, and the held-out rows as (tokens, labels, images, kind)."""
    from torchtitan.build import build_model, build_model_args
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets.sft.finetune import build_sft_data_loader
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.spec import get_model_spec

    config = JobConfig.parse_args(argv)
    spec, tokenizer = get_model_spec(config.model.name), build_tokenizer(config.model.tokenizer_path)
    args = build_model_args(config, spec, tokenizer.n_words, device_type="cpu")
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=1)
    model = build_model(config, args, dims, None, torch.device("cpu")).eval()
    val = task / "shapes_val.jsonl"
    dataset = build_sft_data_loader("vlm_shapes_val", str(val), tokenizer, config.training, [[0]], 1, args).dataset
    lines = val.read_text().splitlines()
    kinds = ["colour" if "colour" in json.loads(line)["messages"][0]["content"] else "shape" for line in lines]
    rows = [(t, lab, imgs, kind) for (t, lab), imgs, kind in zip(dataset._examples, dataset._images, kinds)]
    return model, rows, dataset._processor


@torch.no_grad()
def exact_match(model, rows, processor) -> dict:
    hits = {k: [0, 0] for k in CHANCE}
    for tokens, labels, images, kind in rows:
        ids, labels = torch.tensor([list(tokens)]), torch.tensor(list(labels))
        pixels = torch.cat([processor.pixels(i) for i in images])
        picks = model(ids, pixel_values=pixels, grid_thw=[i.grid for i in images])[0].argmax(-1)
        trained = labels >= 0
        hits[kind][0] += bool((picks[trained] == labels[trained]).all())
        hits[kind][1] += 1
    total = sum(h for h, _ in hits.values()), sum(n for _, n in hits.values())
    chance = sum(CHANCE[k] * n for k, (_, n) in hits.items()) / total[1]
    out = {
        k: {"exact": f"{h}/{n}", "rate": round(h / n, 3), "chance": round(CHANCE[k], 3)} for k, (h, n) in hits.items()
    }
    return {
        **out,
        "all": {"exact": f"{total[0]}/{total[1]}", "rate": round(total[0] / total[1], 3), "chance": round(chance, 3)},
    }


def load_checkpoint(model, step_folder: Path) -> None:
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(step_folder), no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})


def cli_answer(step_folder: Path, task: Path) -> dict:
    row = json.loads((task / "shapes_val.jsonl").read_text().splitlines()[0])
    question = row["messages"][0]["content"].removeprefix("<image>")
    cmd = [sys.executable, "scripts/generate.py", str(step_folder), "--chat", "--image", str(task / row["images"][0])]
    cmd += ["--prompt", question, "--max_new_tokens", "8"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    answer = run.stdout.strip()
    expected = row["messages"][1]["content"]
    return {"question": question, "expected": expected, "answer": answer, "returncode": run.returncode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch_size", type=int, default=8, help="128-token windows per step (about 4 rows each)")
    p.add_argument("--train", type=int, default=600, help="training rows")
    p.add_argument("--val", type=int, default=120, help="held-out rows")
    p.add_argument("--dump_folder", default="/tmp/torchtitan_bench_vlm", help="emptied first")
    args = p.parse_args()
    base = Path(args.dump_folder)
    shutil.rmtree(base, ignore_errors=True)
    task, run = build_task(base / "task", args.train, args.val), base / "run"
    argv = flags(args, task, run)
    model, rows, processor = model_and_rows(argv, task)
    before = exact_match(model, rows, processor)
    start = time.perf_counter()
    trained = subprocess.run(
        [sys.executable, "-m", "torchtitan.train", *argv], cwd=REPO, capture_output=True, text=True
    )
    train_s = time.perf_counter() - start
    if trained.returncode:
        print(trained.stderr[-3000:], file=sys.stderr)
        return 1
    step_folder = run / "checkpoint" / f"step-{args.steps}"
    load_checkpoint(model, step_folder)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    cpu = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")][:1]
    report = {
        "benchmark": "vlm_shapes",
        "device": f"cpu ({cpu[0] if cpu else 'unknown'})",
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "dump_folder"},
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_s": round(train_s, 1),
        "first_train_loss": losses[0],
        "final_train_loss": losses[-1],
        "final_validation_loss": [r["validation_loss"] for r in records if "validation_loss" in r][-1],
        "held_out_before": before,
        "held_out_after": exact_match(model, rows, processor),
        "cli": cli_answer(step_folder, task),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
