"""The cost of synchronous fault tolerance: two replica groups of one rank vs. DDP over the same two ranks.

Both train the same model on the same global batch (2 x batch_size samples a step), one thread per rank,
through run_llama_train.sh: DDP2 as one 2-rank launch, fault tolerance as a lighthouse (loopback) and two
1-rank launches (each step adds a quorum, the groups' config check, the gradient average across the groups in
buckets after backward, the commit, and the exchange of every group's data position). The mean of
metrics.jsonl's ``step_time_s`` over the steps after ``--warmup`` is compared (rank 0's; FT: group 0's). The
runs take turns, ``--reps`` times each, and the medians are compared. Prints one JSON object;
ratio = fault tolerance / DDP (docs/performance.md has the measured figures).

    python -m bench.fault_tolerance [--steps 40] [--warmup 10] [--reps 2] [--flavor debugmodel_tiny]
                                    [--seq_len 64] [--batch_size 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

from torchtitan.features.fault_tolerance.lighthouse import start_lighthouse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _common(args: argparse.Namespace, folder: str) -> list[str]:
    return [
        "--model.flavor",
        args.flavor,
        "--training.steps",
        str(args.steps),
        "--training.seq_len",
        str(args.seq_len),
        "--training.batch_size",
        str(args.batch_size),
        "--training.mixed_precision_param",
        "float32",
        "--activation_checkpoint.mode",
        "none",
        "--metrics.log_freq",
        "1",
        "--job.dump_folder",
        folder,
    ]


def _launch(ngpu: int, argv: list[str], env: dict) -> subprocess.Popen:
    env = {**os.environ, **env, "NGPU": str(ngpu), "PREFLIGHT": "0", "OMP_NUM_THREADS": "1"}
    cmd = ["bash", "./run_llama_train.sh", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _mean_step(folder: str, warmup: int) -> float:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return statistics.fmean(r["step_time_s"] for r in records if r["step"] > warmup)


def _finish(proc: subprocess.Popen, what: str) -> None:
    _, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{err[-3000:]}")


def run_ddp(args: argparse.Namespace, folder: str) -> float:
    argv = [*_common(args, folder), "--training.data_parallel_replicate_degree", "2"]
    argv += ["--training.data_parallel_shard_degree", "1"]
    _finish(_launch(2, argv, {}), "DDP2")
    return _mean_step(folder, args.warmup)


def run_ft(args: argparse.Namespace, folder: str) -> float:
    lighthouse, address = start_lighthouse(2)  # both groups in every quorum: no heal, no group alone
    try:
        groups = []
        for i in (0, 1):
            argv = [*_common(args, folder), "--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
            argv += ["--fault_tolerance.replica_id", str(i)]
            groups.append(_launch(1, argv, {"TORCHFT_LIGHTHOUSE": address}))
        for i, proc in enumerate(groups):
            _finish(proc, f"replica group {i}")
    finally:
        lighthouse.kill()
    return _mean_step(os.path.join(folder, "replica_0"), args.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--flavor", default="debugmodel_tiny")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4)
    args = p.parse_args()
    ddp, ft = [], []
    with tempfile.TemporaryDirectory(prefix="torchtitan_bench_ft_") as tmp:
        for rep in range(args.reps):
            ddp.append(run_ddp(args, os.path.join(tmp, f"ddp{rep}")))
            ft.append(run_ft(args, os.path.join(tmp, f"ft{rep}")))
    result = {
        "config": vars(args),
        "ddp2_step_s": statistics.median(ddp),
        "ft_2x1_step_s": statistics.median(ft),
        "ratio_ft_over_ddp": statistics.median(ft) / statistics.median(ddp),
        "ddp2_runs_step_s": ddp,
        "ft_2x1_runs_step_s": ft,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
