"""The ordered list of pre-launch checks and the function that runs it (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchtitan.checkpointing.checks import check_checkpoint, check_initial_load
from torchtitan.components.attention_checks import check_attention, check_attention_device
from torchtitan.components.float8 import check_float8, check_torchao_installed
from torchtitan.components.in_backward_checks import check_in_backward
from torchtitan.components.lr_schedule import check_lr_schedule
from torchtitan.components.memory_checks import check_memory_options
from torchtitan.components.param_groups import check_param_groups
from torchtitan.components.replay_checks import check_replay
from torchtitan.config.bounds import check_not_built, check_ranges
from torchtitan.datasets.checks import check_data_paths
from torchtitan.datasets.sft.checks import check_fine_tuning
from torchtitan.distributed.activation_checkpoint import check_activation_checkpoint
from torchtitan.distributed.cp_checks import check_context_parallel
from torchtitan.distributed.parallel_dims import ParallelDims, check_data_parallel
from torchtitan.distributed.tp_checks import check_async_tp_device, check_tensor_parallel
from torchtitan.eval.checks import check_eval, check_eval_tasks
from torchtitan.fault_tolerance.checks import check_fault_tolerance, check_fault_tolerance_machine
from torchtitan.launch.run_folder import check_dump_folder
from torchtitan.lora.checks import check_lora, check_qlora_torchao
from torchtitan.observability.metrics import check_metrics
from torchtitan.observability.profiling import check_memory_snapshot_device, check_profiling
from torchtitan.spec import check_model

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig


@dataclass(frozen=True)
class Check:
    """One feature's pre-launch check.

    ``this_machine``: it reads this machine's files or devices; the memory estimator, which plans for
    the machine the run will use, skips it.
    """

    fn: Callable[[JobConfig, ParallelDims], list[str]]
    this_machine: bool = False


# The order is the order a config with several problems hears about them: the layout's features
# first, then the model against the layout, then files, then the bookkeeping keys.
CHECKS: tuple[Check, ...] = (
    Check(check_memory_snapshot_device, this_machine=True),
    Check(check_activation_checkpoint),
    Check(check_memory_options),
    Check(check_data_parallel),
    Check(check_fault_tolerance),
    Check(check_fault_tolerance_machine, this_machine=True),
    Check(check_param_groups),
    Check(check_in_backward),
    Check(check_replay),
    Check(check_lr_schedule),
    Check(check_float8),
    Check(check_torchao_installed, this_machine=True),
    # The family and flavor exist; the flavor's shapes under TP and PP; the family's own check (FFN width, experts).
    Check(check_model),
    Check(check_lora),
    Check(check_qlora_torchao, this_machine=True),
    Check(check_tensor_parallel),
    Check(check_async_tp_device, this_machine=True),
    Check(check_context_parallel),
    Check(check_attention),
    Check(check_attention_device, this_machine=True),
    Check(check_fine_tuning),
    Check(check_data_paths, this_machine=True),
    Check(check_initial_load, this_machine=True),
    Check(check_dump_folder, this_machine=True),
    Check(check_eval),
    Check(check_eval_tasks, this_machine=True),
    Check(check_profiling),
    Check(check_metrics),
    Check(check_checkpoint),
)


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
