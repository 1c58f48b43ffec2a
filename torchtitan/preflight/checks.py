"""The ordered list of pre-launch checks and the function that runs it (see the package docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.bounds import check_not_built, check_ranges
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.preflight.registry import FEATURES, Check

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig

# Every check, in the registry's order (preflight/registry.py says why that order).
CHECKS: tuple[Check, ...] = tuple(check for feature in FEATURES for check in feature.checks)


def run_preflight(config: JobConfig, world_size: int, *, this_machine: bool = True) -> list[str]:
    """Check ``config`` for a run of ``world_size`` processes; raise on the first problem, return warnings.

    The schema's own ranges and unavailable keys come first (config/bounds.py), then the degrees
    (``ParallelDims`` raises when they do not fit the world size), then ``CHECKS`` in order.
    ``this_machine=False`` (the memory estimator) skips the checks of this machine's files and devices.
    """
    check_ranges(config)
    check_not_built(config)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    warnings: list[str] = []
    for check in CHECKS:
        if this_machine or not check.this_machine:
            warnings += check.fn(config, dims)
    return warnings
