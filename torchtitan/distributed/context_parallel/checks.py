"""Pre-launch checks of context parallel (light: no DTensor import; the preflight runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchtitan.config.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

# context_parallel_impl = "torch" rests on private names of torch (distributed/context_parallel/torch_context_parallel.py): the
# releases whose names and behaviour were checked (the cp2_torch row, scripts/check_torch_versions.sh), oldest and
# newest (major, minor). Their templates, options and dispatcher agree from 2.11 to 2.15.
TORCH_CP_CHECKED = ((2, 11), (2, 15))


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_cp_supported() -> None:
    """Raise NotImplementedError unless this torch is a release the private names were checked against."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TORCH_CP_CHECKED
    if not TORCH_CP_CHECKED[0] <= _release(torch.__version__) <= TORCH_CP_CHECKED[1]:
        raise NotImplementedError(
            f"experimental.context_parallel_impl = 'torch' uses private names of torch "
            f"(torch.distributed.tensor.experimental._context_parallel) checked on torch {lo_major}.{lo_minor} to "
            f"{hi_major}.{hi_minor}, and this is torch {torch.__version__}; use context_parallel_impl = 'portable' "
            "(our ring attention, any torch)"
        )


def check_context_parallel(config: JobConfig, dims: ParallelDims) -> list[str]:
    """CP splits each sequence into cp (or 2 x cp, load-balanced) equal chunks; sequence parallel splits them again."""
    exp, t = config.experimental, config.training
    cp = exp.context_parallel_degree
    if cp == 1:
        return []
    chunks = 2 * cp if exp.context_parallel_load_balance else cp
    how = (
        "2 x context_parallel_degree (load balancing)"
        if exp.context_parallel_load_balance
        else "context_parallel_degree"
    )
    if t.seq_len % chunks:
        raise ConfigError(
            f"training.seq_len = {t.seq_len} is not divisible by {how} = {chunks}; "
            f"choose a seq_len that is a multiple of {chunks}"
        )
    tp = t.tensor_parallel_degree
    if tp > 1 and (t.seq_len // cp) % tp:
        raise ConfigError(
            f"training.seq_len / context_parallel_degree = {t.seq_len // cp} is not divisible by "
            f"training.tensor_parallel_degree = {tp} (sequence parallel splits each CP chunk again); "
            f"choose a seq_len that is a multiple of {cp * tp}"
        )
    if exp.context_parallel_impl == "torch":
        check_torch_cp_supported()
    if t.compile:
        raise NotImplementedError(
            "experimental.context_parallel_degree > 1 with training.compile = true: ring attention is eager "
            "point-to-point code that full-graph compile cannot trace; turn one of them off"
        )
    return []
