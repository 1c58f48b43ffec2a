"""The ordered list of pre-launch checks and the function that runs it (see the package docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.bounds import check_not_built, check_ranges
from torchtitan.distributed.backend.device import get_device_info
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.features.registry import FEATURES, Check

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig

# Every check, in the registry's order (features/registry.py says why that order).
CHECKS: tuple[Check, ...] = tuple(check for feature in FEATURES for check in feature.checks)


def run_preflight(
    config: JobConfig, world_size: int, *, this_machine: bool = True, device_type: str | None = None
) -> list[str]:
    """Check ``config`` for a run of ``world_size`` processes; raise on the first problem, return warnings.

    The schema's own ranges and unavailable keys come first (config/bounds.py), then the degrees
    (``ParallelDims`` raises when they do not fit the world size), then ``CHECKS`` in order, less those
    ``skips`` names.

    Args:
        this_machine: the run trains on this machine: its files, packages and environment are checked (False:
            the memory estimator and ``--target``, which check for other machines).
        device_type: the kind of device the run trains on; None: this machine's with ``this_machine``, else
            unknown, and the device checks are skipped.
    """
    check_ranges(config)
    check_not_built(config)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    if device_type is None and this_machine:
        device_type = get_device_info(0).device.type  # the device the trainer will pick here
    warnings: list[str] = []
    for check in CHECKS:
        if skips(check, this_machine=this_machine, device_type=device_type):
            continue
        warnings += check.fn(config, dims, device_type) if check.reads == "device" else check.fn(config, dims)
    return warnings


def skips(check: Check, *, this_machine: bool, device_type: str | None) -> bool:
    """Whether ``run_preflight`` with these arguments leaves ``check`` out (registry.py's ``Check`` says when)."""
    return (check.reads == "machine" and not this_machine) or (check.reads == "device" and device_type is None)


def not_checked_here(config: JobConfig) -> list[str]:
    """What the machine checks of the parts ``config`` turns on check (each ``Check.what``): the list a check for
    another machine (``--target``) leaves to the machines that train."""
    on = [f for f in FEATURES if f.enabled is None or f.is_on(config)]
    return [check.what for feature in on for check in feature.checks if check.reads == "machine"]
