"""Several trainer jobs in one torchrun launch: ``torchrun --nproc_per_node N -m tests.batch_runs SPEC.json``.

Starting N worker processes costs more on the 2-core CI machine than a 6-step debug run trains
(each worker starts Python and imports torch, ~3 s of CPU, and the 2 cores are shared by all N).
The loss-parity matrix therefore runs all its rows of one world size in one launch: the workers
join one gloo process group and run each job through ``torchtitan.train.run_job`` (the trainer's
own validate, run records, build, train, close), one after the other, under that group.

SPEC.json is a list of jobs, each ``{"argv": [config arguments]}`` (optionally ``"expect_error": text``:
the job must fail on every rank with an error containing the text, and the launch goes on); a job's dump folder comes from
its ``--job.dump_folder``. Per job, every rank writes its log to ``<dump>/rank<r>.log`` and rank 0
writes ``<dump>/job_status.json``: ``{"ok": bool, "error": str | None, "seconds": float}``.

Isolation between jobs: each job seeds its RNG and sets its own determinism (reset to off before
it); its model, optimizer and data loader are freed before the next. After each job the ranks
agree (an all-reduce) whether every rank finished it; if one did not, the launch stops there,
because a half-finished collective could leave the group out of step, and the later jobs get no
status file (the test reports them as not run).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from torchtitan.config.manager import JobConfig
from torchtitan.distributed.device import get_device_info, init_distributed
from torchtitan.observability.logging import init_logger
from torchtitan.train import run_job

STATUS_FILE = "job_status.json"


def _dump_folder(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--job.dump_folder":
            return argv[i + 1]
        if arg.startswith("--job.dump_folder="):
            return arg.split("=", 1)[1]
    raise ValueError(f"job without --job.dump_folder: {argv}")


def _run_one(argv: list[str], world_size: int, rank: int) -> str | None:
    """Run one job on this rank; return None or the error text."""
    folder = _dump_folder(argv)
    os.makedirs(folder, exist_ok=True)
    handler = logging.FileHandler(os.path.join(folder, f"rank{rank}.log"), mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.getLogger().addHandler(handler)
    torch.use_deterministic_algorithms(False)  # the job turns it on if it asks for it
    try:
        run_job(JobConfig.parse_args(argv), world_size=world_size, rank=rank)
        return None
    except BaseException:  # noqa: BLE001 - reported in the status file, the launch then stops
        error = traceback.format_exc()
        logging.getLogger(__name__).error("job failed:\n%s", error)
        return error
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
        gc.collect()


def main(spec_path: str) -> int:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    init_logger()
    with open(spec_path) as f:
        jobs = json.load(f)
    init_distributed(get_device_info(), timeout_s=300)
    try:
        for job in jobs:
            start = time.perf_counter()
            error = _run_one(job["argv"], world_size, rank)
            expect = job.get("expect_error")
            failed = torch.tensor([0 if error is None else 1])
            dist.all_reduce(failed)
            # A job expected to fail passes when every rank raised the expected error: the ranks
            # stopped at the same point, so the group is still in step for the next job.
            as_expected = expect is not None and failed.item() == world_size and expect in (error or "")
            if rank == 0:
                ok = failed.item() == 0 if expect is None else as_expected
                status = {"ok": ok, "error": error, "seconds": time.perf_counter() - start}
                if expect is not None and not as_expected:
                    status["error"] = f"expected every rank to fail with {expect!r}; {failed.item()} failed: {error}"
                elif error is None and failed.item():
                    status["error"] = f"{failed.item()} other rank(s) failed; see rank*.log"
                with open(os.path.join(_dump_folder(job["argv"]), STATUS_FILE), "w") as f:
                    json.dump(status, f)
            if failed.item() and not as_expected:
                return 1
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
