"""lm-eval backend cost (docs/evaluation.md, Cost): loglikelihood requests/s of ours vs lm-eval's ``hf`` backend on
our HF export of the same model, one process, one thread; and one in-loop eval of ``arith_mc`` vs one training step.

A seed checkpoint of train_configs/sft_debug.toml at ``FLAVOR`` (written once into OUT, with its HF export); the
176 requests of arith_mc (44 questions x 4 choices), batch 8, fp32; the two backends alternate, best of 5.

    python -m bench.eval_vs_hf OUT [FLAVOR]      # FLAVOR default debugmodel; needs the dev extra (accelerate)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

CONFIG = "train_configs/sft_debug.toml"
TURN = (
    "<|im_start|>system\nAdd numbers.<|im_end|>\n<|im_start|>user\nWhat is {a} plus {b}?<|im_end|>\n"
    "<|im_start|>assistant\n{a} plus {b} is"
)


def _requests() -> list:
    from lm_eval.api.instance import Instance

    reqs = []
    for line in open("torchtitan/eval/tasks/arith_mc/arith_mc.jsonl"):
        doc = json.loads(line)
        for choice in doc["choices"]:
            reqs.append(Instance("loglikelihood", doc, (TURN.format(**doc), " " + choice), len(reqs)))
    return reqs


def _requests_per_second(argv: list[str], out: str) -> None:
    from lm_eval.models.huggingface import HFLM

    from torchtitan.eval.lm import TorchtitanLM

    ckpt = os.path.join(out, "checkpoint", "step-0")
    ours = TorchtitanLM(config=CONFIG, checkpoint=ckpt, overrides=" ".join(argv[2:]), batch_size=8)
    hf = HFLM(
        pretrained=os.path.join(out, "hf"),
        tokenizer="tests/assets/sft/tokenizer",
        batch_size=8,
        max_length=128,
        dtype="float32",
        device="cpu",
    )
    reqs = _requests()
    for lm in (ours, hf):
        lm.loglikelihood(reqs[:16], disable_tqdm=True)  # warm up
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(5):
        for name, lm in (("ours", ours), ("hf", hf)):
            start = time.perf_counter()
            lm.loglikelihood(reqs, disable_tqdm=True)
            times[name].append(time.perf_counter() - start)
    best = {k: min(v) for k, v in times.items()}
    print(f"{len(reqs)} loglikelihood requests, batch 8, 1 thread; best of 5 (alternating)")
    for name, runs in times.items():
        print(f"  {name}: {len(reqs) / best[name]:.1f} requests/s (runs {[round(t, 3) for t in runs]})")
    print(f"  ratio ours/hf: {best['hf'] / best['ours']:.2f}x")


def _in_loop_cost(argv: list[str], out: str) -> None:
    from torchtitan.config.manager import JobConfig
    from torchtitan.train import Trainer

    extra = ["--training.steps", "20", "--job.dump_folder", out + "_loop", "--validation.enabled", "false"]
    extra += ["--eval.enabled", "--eval.tasks", "arith_mc", "--eval.freq", "1000"]
    trainer = Trainer(JobConfig.parse_args([*argv, *extra]), world_size=1, rank=0)
    trainer.data_iter = iter(trainer.data_loader)
    steps, evals = [], []
    for _ in range(6):
        start = time.perf_counter()
        trainer.run_step()
        steps.append(time.perf_counter() - start)
    for _ in range(2):
        start = time.perf_counter()
        record = trainer.parts.after_step[-1].run()  # the in-loop evaluation (after validation, if on)
        evals.append(time.perf_counter() - start)
    trainer.close()
    step = sorted(steps[1:])[len(steps[1:]) // 2]
    print(
        f"in-loop: training step median {step:.3f} s (steps {[round(s, 3) for s in steps]}); one eval of arith_mc "
        f"(176 requests) {min(evals):.2f} s (runs {[round(e, 2) for e in evals]}) = {min(evals) / step:.1f} steps; "
        f"{record}"
    )


def main() -> None:
    torch.set_num_threads(1)
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    out = sys.argv[1]
    flavor = sys.argv[2] if len(sys.argv) > 2 else "debugmodel"
    argv = ["--job.config_file", CONFIG, "--model.flavor", flavor, "--job.dump_folder", out]
    argv += ["--training.data_parallel_shard_degree", "1"]
    ckpt = os.path.join(out, "checkpoint", "step-0")
    if not os.path.isdir(ckpt):
        from torchtitan.build import create_seed_checkpoint
        from torchtitan.checkpointing.hf.convert import export_to_hf
        from torchtitan.config.manager import JobConfig

        create_seed_checkpoint(JobConfig.parse_args(argv))
        export_to_hf(ckpt, os.path.join(out, "hf"))
    print(f"flavor {flavor}")
    _requests_per_second(argv, out)
    _in_loop_cost(argv, out)


if __name__ == "__main__":
    main()
