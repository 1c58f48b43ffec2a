"""Real-run measurement for the accuracy tests: ``torchrun ... -m torchtitan.estimation.measure OUT.json CASES.json``.

Every rank runs each case (a list of config arguments) with real tensors under the real gloo group:
the trainer's build and two steps under the same tracker as the estimate, plus the peak RSS growth
over the RSS just before the build. Set ``MALLOC_MMAP_THRESHOLD_`` so freed buffers go back to
the OS; the peak is reset per case through /proc/self/clear_refs (Linux).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys

import torch.distributed as dist

from torchtitan.config.manager import JobConfig
from torchtitan.estimation.estimate import check_estimable, estimate_rank
from torchtitan.estimation.fake_trainer import resolve_vocab
from torchtitan.preflight import run_preflight


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def _release_and_reset_peak() -> int:
    """Free what can be freed, reset the peak-RSS mark; return the current RSS in bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def measure_case(argv: list[str], world_size: int, rank: int) -> dict:
    config = JobConfig.parse_args(argv, world_size=world_size)
    run_preflight(config, world_size)
    check_estimable(config, world_size)
    vocab, _ = resolve_vocab(config)
    dist.barrier()
    baseline = _release_and_reset_peak()
    memory = estimate_rank(config, world_size, rank, vocab, fake=False)
    rss_peak = _status_kib("VmHWM") * 1024 - baseline
    dist.barrier()
    phases = {name: phase.total for name, phase in memory.phases.items()}
    return {"tracker_peak": memory.peak, "rss_peak": rss_peak, "breakdown": memory.breakdown, "phases": phases}


def main(out_path: str, cases_path: str) -> None:
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dist.init_process_group("gloo")
    gc.freeze()  # what is loaded now lives until exit: each case's full collections scan only what cases made
    try:
        with open(cases_path) as f:
            cases = json.load(f)
        results = {}
        for name, argv in cases.items():
            results[name] = measure_case(argv, world_size, rank)
            gc.collect()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, results)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # Results are written and the group destroyed. Skip interpreter finalization: gloo worker
    # threads can still hold works whose tensors need the GIL while the interpreter is torn down,
    # which aborts the process now and then ("terminate called without an active exception";
    # pytorch/pytorch#179291), failing a measurement that is complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
