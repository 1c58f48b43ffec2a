"""Pre-launch: the ``[fault_tolerance]`` keys, against each other and the rest of the config (light: torchft is
looked up, not imported; the preflight runs this before any process group exists)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError
from torchtitan.datasets.indexed.format import find_prefixes
from torchtitan.features.fault_tolerance.errors import INSTALL_HINT
from torchtitan.features.fault_tolerance.lighthouse import LIGHTHOUSE_ENV, split_address

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_fault_tolerance(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The keys' values and what fault tolerance cannot compose with.

    Raises:
        ConfigError: a value out of range or contradicting another key, naming both and the fix.
        NotImplementedError: a combination not built, naming it.
    """
    ft = config.fault_tolerance
    if not ft.enable:
        changed = [f.name for f in dataclasses.fields(ft) if getattr(ft, f.name) != f.default]
        if changed:
            return [f"fault_tolerance.{changed[0]} has no effect without fault_tolerance.enable = true"]
        return []
    if ft.group_size < 1 or ft.replica_id >= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id = {ft.replica_id} with group_size = {ft.group_size}: group_size is the number "
            "of replica groups (>= 1) and each launch's replica_id one of 0 .. group_size - 1; e.g. "
            "--fault_tolerance.group_size 2 --fault_tolerance.replica_id 0 (and 1 for the second launch)"
        )
    if ft.min_replica_size > ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size = {ft.min_replica_size} > group_size = {ft.group_size}: no step could "
            "ever commit; set it to at most the number of replica groups (1 keeps training while any group lives)"
        )
    if dims.dp_replicate > 1:
        raise ConfigError(
            f"fault_tolerance.enable with training.data_parallel_replicate_degree = {dims.dp_replicate}: the replica "
            "groups are the replicate dimension (each launch is one group); set data_parallel_replicate_degree = 1 "
            "and launch that many groups (fault_tolerance.group_size)"
        )
    _check_composition(config)
    if ft.semi_sync_method is not None:
        _check_semi_sync(config)
    return []


def _check_composition(config: JobConfig) -> None:
    ft, ck = config.fault_tolerance, config.checkpoint
    if ck.enable_checkpoint and ck.keep_latest_k == 1 and ft.semi_sync_method is None:
        raise ConfigError(
            "fault_tolerance.enable with checkpoint.keep_latest_k = 1: the replica groups share the checkpoint folder, "
            "and a group restarting while the writing group saves could have the checkpoint it reads deleted under "
            "it; keep at least 2 (or 0: all)"
        )
    replay = config.training.replay_every_n_steps
    if replay > 0:  # step replay's own check would say the same; the composition is this feature's to refuse
        raise NotImplementedError(
            f"training.replay_every_n_steps = {replay} with fault_tolerance.enable = true: not built for replica groups "
            "yet; set training.replay_every_n_steps = 0 or change that"
        )
    t = config.training
    if t.dataset_mix is not None or (t.dataset_path is not None and find_prefixes(t.dataset_path) is not None):
        # replica groups exchange loader states at different steps; the blend's state is per step: untested here
        raise NotImplementedError(
            "indexed data or training.dataset_mix with fault_tolerance.enable = true is not supported yet; train "
            "fault-tolerant runs on text data (training.dataset_path to a .jsonl/.parquet corpus)"
        )
    if ck.enable_checkpoint and ck.async_mode == "async_with_pinned_mem" and ft.semi_sync_method is None:
        raise NotImplementedError(  # LocalSGD and DiLoCo change the weights in hooks after the optimizer step
            "fault_tolerance.enable (synchronous) with checkpoint.async_mode = 'async_with_pinned_mem': a heal replaces "
            "a group's weights at the start of a step, while the checkpoint's background copy (waited for before the "
            "optimizer step) may still read them; use async_mode = 'async'"
        )
    if config.optimizer.early_step_in_backward:
        raise NotImplementedError(
            "fault_tolerance.enable with optimizer.early_step_in_backward = true: each parameter would step during "
            "backward, before its gradient is averaged over the replica groups and before they agree to commit; "
            "turn one of them off"
        )


def _check_semi_sync(config: JobConfig) -> None:
    ft, ck, t = config.fault_tolerance, config.checkpoint, config.training
    what = f"fault_tolerance.semi_sync_method = {ft.semi_sync_method!r} (sync_steps = {ft.sync_steps})"
    if t.steps % ft.sync_steps:
        raise ConfigError(
            f"{what} with training.steps = {t.steps}: the run must end on a synchronization, where every group holds "
            "the same weights (the last checkpoint and export); make training.steps a multiple of sync_steps"
        )
    if ck.enable_checkpoint and (ck.interval_type != "steps" or ck.interval % ft.sync_steps):
        raise ConfigError(
            f"{what} with checkpoint.interval = {ck.interval} {ck.interval_type}: a checkpoint is written just after a "
            "synchronization, where every group holds the same weights; set checkpoint.interval_type = 'steps' and "
            "an interval that is a multiple of sync_steps"
        )
    if t.on_nonfinite == "skip":
        raise NotImplementedError(
            f"{what} with training.on_nonfinite = 'skip': a skipped local step would put this group's "
            "synchronizations out of step with the others'; set training.on_nonfinite = 'stop'"
        )


def check_fault_tolerance_machine(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: torchft installed, the lighthouse's address set."""
    ft = config.fault_tolerance
    if not ft.enable:
        return []
    if importlib.util.find_spec("torchft") is None:
        raise NotImplementedError(INSTALL_HINT)
    address = os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ConfigError(
            f"fault_tolerance.enable needs the lighthouse's address in {LIGHTHOUSE_ENV} (e.g. "
            f"{LIGHTHOUSE_ENV}=http://localhost:29510); start one with: torchft_lighthouse --min_replicas 1 "
            "--bind [::]:29510 (scripts/ft_local.sh runs a local job)"
        )
    try:
        split_address(address)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return []


def check_fault_tolerance_device(config: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """On ``device_type``: the user's backend between replica groups exists there (NCCL only with CUDA)."""
    ft = config.fault_tolerance
    if ft.enable and ft.process_group == "nccl" and device_type != "cuda":
        raise NotImplementedError(
            f"fault_tolerance.process_group = 'nccl' needs CUDA, and the run trains on {device_type!r}; use 'gloo'"
        )
    return []
