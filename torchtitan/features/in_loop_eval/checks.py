"""Pre-launch checks of ``[eval]`` (the preflight list runs them before any process starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_eval(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The keys of ``[eval]`` make sense together and with the layout."""
    ev = config.eval
    if not ev.enabled:
        return []
    if not ev.tasks:
        raise ValueError(
            "eval.enabled = true with eval.tasks = []: name the tasks to run (e.g. eval.tasks = ['arith_mc'])"
        )
    if dims.pp > 1 or dims.cp > 1:
        raise NotImplementedError(
            f"eval.enabled with pipeline_parallel_degree = {dims.pp}, context_parallel_degree = {dims.cp}: the in-loop "
            "evaluation runs FSDP2, DDP/HSDP and tensor parallel layouts; evaluate a checkpoint instead "
            "(python -m torchtitan.eval, docs/evaluation.md)"
        )
    if ev.num_fewshot is not None and ev.num_fewshot < 0:
        raise ValueError(f"eval.num_fewshot = {ev.num_fewshot}: must be >= 0 (or unset for each task's default)")
    return []


def check_eval_tasks(config: JobConfig, dims: ParallelDims) -> list[str]:
    """lm-eval is installed, the task files under ``eval.include_path`` parse and every task name exists."""
    ev = config.eval
    if not ev.enabled:
        return []
    from torchtitan.eval.tasks import build_task_manager

    build_task_manager(list(ev.tasks), ev.include_path)
    return []
