"""The ``[rl]`` section's pre-launch checks (light: no model, no data stack)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_rl(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The RL step's shape fits the layout; what the loop is not built for is refused."""
    rl, t = config.rl, config.training
    if not rl.enable:
        return []
    if rl.group_size < 2:
        raise ValueError(
            f"rl.group_size = {rl.group_size}: advantages compare the completions of one prompt, so a group needs at "
            "least 2; set rl.group_size >= 2 (4-16 is usual)"
        )
    for name, degree in (("pipeline_parallel_degree", dims.pp), ("context_parallel_degree", dims.cp)):
        if degree > 1:
            raise NotImplementedError(
                f"rl.enable with experimental.{name} = {degree}: not built (generation runs the whole model on every "
                "rank, token by token); use FSDP, HSDP or TP, or an outside engine's rollouts (rl.rollouts_path)"
            )
    if not rl.prompts_path:
        raise ValueError(
            "rl.enable needs rl.prompts_path: a JSONL of prompts (an outside engine reading rl.rollouts_path samples the "
            "run's prompts from it too)"
        )
    _check_sampling(config)
    _check_staleness(config)
    if rl.environment and rl.rollouts_path:
        raise ValueError(
            f"rl.environment = {rl.environment!r} with rl.rollouts_path = {rl.rollouts_path!r}: an outside engine "
            "generates the rollouts, so it runs the episodes (its rows' env_mask marks the environment's tokens); unset one"
        )
    if rl.top_p > 1:
        raise ValueError(f"rl.top_p = {rl.top_p}: a probability mass in (0, 1]")
    if rl.clip_low >= 1:
        raise ValueError(
            f"rl.clip_low = {rl.clip_low}: the ratio's floor 1 - clip_low must be positive; use a value < 1"
        )
    for key, value, why in (
        ("training.dataset_format", t.dataset_format != "text", "RL reads its prompts from rl.prompts_path"),
        (
            "model.attn_mask_type",
            config.model.attn_mask_type != "causal",
            "each RL sequence is one prompt + completion",
        ),
        ("training.loss_chunk_size", t.loss_chunk_size > 0, "the RL loss reads every position's log-prob"),
        ("training.compile", t.compile, "generation's shapes change every token"),
    ):
        if value:
            raise NotImplementedError(
                f"rl.enable with {key} = {getattr(*_section(config, key))!r}: not built ({why}); unset it"
            )
    _check_shape(config, dims)
    return []


def _check_sampling(config: JobConfig) -> None:
    """Greedy sampling (temperature 0, top_k 1) gives a group ``group_size`` copies of one completion: equal rewards,
    every advantage 0, nothing learned. GRPO's and DAPO's groups are sampled, so it is refused; with rl.rollouts_path
    too: the keys then describe the engine's sampling (scripts/rl_engine.py samples with them), and rl.temperature is
    the temperature at which the update recomputes the log-probs of the ratio."""
    rl = config.rl
    engine = " by the engine (with rl.rollouts_path these keys describe its sampling)" if rl.rollouts_path else ""
    temperature_fix = "set rl.temperature > 0 (1.0 is usual" + ("; the engine's temperature)" if engine else ")")
    for key, value, greedy, fix in (
        ("rl.temperature", rl.temperature, rl.temperature == 0, temperature_fix),
        ("rl.top_k", rl.top_k, rl.top_k == 1, "set rl.top_k = 0 (every token) or > 1"),
    ):
        if greedy:
            raise ValueError(
                f"{key} = {value:g} is greedy sampling{engine}: with rl.group_size = {rl.group_size} every completion "
                "of a group is the same, so its rewards are equal, every advantage is 0 and nothing is learned; " + fix
            )


def _check_staleness(config: JobConfig) -> None:
    """Asynchronous rollouts come from the run's own generator process, which reloads every step's policy."""
    rl = config.rl
    if rl.max_staleness == 0:
        return
    if rl.rollouts_path:
        raise ValueError(
            f"rl.max_staleness = {rl.max_staleness} with rl.rollouts_path = {rl.rollouts_path!r}: an outside engine "
            "already generates the rollouts, and its staleness is its own (scripts/rl_engine.py --lag); unset one"
        )
    if rl.publish_every > 1:
        raise ValueError(
            f"rl.max_staleness = {rl.max_staleness} with rl.publish_every = {rl.publish_every}: the generator reloads "
            "the policy of every step, so it is published every step; unset rl.publish_every (or set it to 1)"
        )


def _section(config: JobConfig, key: str) -> tuple[object, str]:
    section, name = key.split(".")
    return getattr(config, section), name


def _check_shape(config: JobConfig, dims: ParallelDims) -> None:
    """A step's completions split evenly into updates, data-parallel ranks and micro-batches."""
    rl, t = config.rl, config.training
    dp = dims.dp_degree
    if rl.prompts_per_step % dp:
        raise ValueError(
            f"rl.prompts_per_step = {rl.prompts_per_step} is not a multiple of the data-parallel degree {dp} (each dp "
            "rank generates the same number of groups); use a multiple of it"
        )
    sequences = rl.prompts_per_step * rl.group_size
    per_rank = sequences / (rl.updates_per_step * dp)
    if per_rank != t.batch_size * t.gradient_accumulation_steps:
        raise ValueError(
            f"an RL update trains {sequences} completions (rl.prompts_per_step x rl.group_size) / rl.updates_per_step "
            f"{rl.updates_per_step} / data-parallel degree {dp} = {per_rank:g} per rank, and training.batch_size x "
            f"training.gradient_accumulation_steps = {t.batch_size} x {t.gradient_accumulation_steps}; make them equal "
            "(batch_size is the micro-batch of completions)"
        )


def check_rl_machine(config: JobConfig, dims: ParallelDims) -> list[str]:
    """The prompts file exists and the reward function imports."""
    rl = config.rl
    if not rl.enable:
        return []
    if rl.prompts_path and not os.path.isfile(rl.prompts_path):
        raise FileNotFoundError(f"rl.prompts_path = '{rl.prompts_path}' does not exist")
    if rl.environment and not rl.rollouts_path:
        from torchtitan.features.rl.environments import load_environment

        load_environment(rl.environment)
    elif not rl.rollouts_path:
        from torchtitan.features.rl.rewards import load_reward

        load_reward(rl.reward)
    return []
