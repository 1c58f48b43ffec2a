"""An RL step's records (metrics.jsonl's fields, TensorBoard's ``rl/...``) and the console's ``rl`` line under each step
line (docs/rl.md, "Records")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchtitan.config.sections.rl import Rl
    from torchtitan.features.rl.rollouts import Rollout


def step_records(
    rl: Rl,
    step: int,
    rollouts: list[Rollout],
    dropped: int,
    generation_s: float,
    update_s: float,
    update_tps: float,
) -> dict[str, float]:
    """The step's rewards, lengths and rates; ``generation_s``: the seconds its rollouts took to come (generated
    here, or waited for); with ``rl.max_staleness``, the generator's staleness, seconds and the share overlapped."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    lengths = torch.tensor([r.model_tokens for r in rollouts], dtype=torch.float64)  # the policy's tokens
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rollouts) > 1 else 0.0,
        "accuracy": float((rewards >= rl.correct_reward).double().mean()),
        "completion_length": float(lengths.mean()),
        "dropped_groups": float(dropped),
        "update_tps": update_tps,
    }
    if rl.generates_in_process():  # reading an engine's rows generates nothing here: no generation rate
        stats["generation_tps"] = float(lengths.sum()) / max(generation_s, 1e-9)
    if rl.max_staleness > 0:
        stale = [step - 1 - r.policy_step for r in rollouts]
        generator_s = rollouts[0].generation_s
        stats.update(
            staleness_mean=sum(stale) / len(stale),
            staleness_max=float(max(stale)),
            generation_s=generator_s,
            rollout_wait_s=generation_s,
            update_s=update_s,
            overlap=max(0.0, 1.0 - generation_s / generator_s) if generator_s > 0 else 0.0,
        )
    return stats


def format_rl_line(step: int, stats: dict[str, float]) -> str:
    """The console's RL line under each step line."""
    s = stats
    kl = f"  kl {s['kl']:.2e}" if "kl" in s else ""
    bad = s.get("nonfinite_logprob_tokens", 0.0)
    masked = f"  non-finite log-probs {bad:.0f} (left out)" if bad else ""
    source = f"generation {s['generation_tps']:,.0f} tok/s" if "generation_tps" in s else "rollouts read from the file"
    if "staleness_max" in s:  # the asynchronous generator's
        source = (
            f"staleness {s['staleness_mean']:.1f} (max {s['staleness_max']:.0f})  generation {s['generation_s']:.2f} s "
            f"(waited {s['rollout_wait_s']:.2f} s: {s['overlap']:.0%} overlapped)"
        )
    return (
        f"rl   {step}  reward {s['reward_mean']:.3f} (std {s['reward_std']:.3f})  accuracy {s['accuracy']:.3f}  length "
        f"{s['completion_length']:.1f}  clipped {s['clip_fraction']:.3f}{kl}  off-policy {s['offpolicy_gap']:.1e}{masked}  dropped "
        f"{s['dropped_groups']:.0f}  {source}  update {s['update_tps']:,.0f} tok/s"
    )
