"""GRPO and DAPO: advantages per group, per-token weights over the whole update, the clipped policy loss.

Everything that needs more than one completion (a group's mean and std, a mini-batch's token count) is computed
here over the whole step's completions, which every rank holds, before a rank takes its share: so a loss and its
gradient are the same under every layout (one process, FSDP, TP, accumulation), however a group is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchtitan.components.run_control import NonFiniteStep

if TYPE_CHECKING:
    from torchtitan.features.rl.rollouts import UpdateBatch

ADVANTAGE_EPS = 1e-6  # added to a group's reward std: a group of equal rewards has advantages 0, not NaN


def group_advantages(rewards: torch.Tensor, *, std_normalize: bool) -> torch.Tensor:
    """rewards (groups, group_size) -> advantages of the same shape: reward - its group's mean, divided by the
    group's std (unbiased, + eps) with ``std_normalize`` (GRPO), not without it (Dr. GRPO)."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_normalize:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + ADVANTAGE_EPS)


def token_weights(mask: torch.Tensor, *, algorithm: str, finite: torch.Tensor | None = None) -> torch.Tensor:
    """mask (sequences, seq_len) of an update's completion tokens -> each token's weight in the update's loss (the
    weights sum to 1). 'grpo': each sequence's tokens averaged, then the sequences; 'dapo': every token alike.

    finite (the same shape): False where the generator's log-prob is not finite. Such a token weighs 0 and counts in
    no denominator (neither a sequence's length nor the update's token count); nor does a sequence left with no token
    (in GRPO's mean over the sequences). With every log-prob finite, the weights are those without ``finite``.
    """
    sequences: int | torch.Tensor = mask.shape[0]
    if finite is not None:  # no host sync: the memory estimator runs this on fake tensors
        kept = mask & finite
        emptied = (mask.any(dim=1) & ~kept.any(dim=1)).sum()  # sequences whose every completion token is not finite
        sequences, mask = (sequences - emptied).clamp(min=1), kept  # an int64 scalar: divides as the int did
    mask = mask.float()
    if algorithm == "dapo":
        return mask / mask.sum().clamp(min=1.0)
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # (sequences, 1)
    return mask / lengths / sequences


@dataclass(frozen=True)
class Clip:
    low: float
    high: float


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip: Clip,
    *,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    proximal_logprobs: torch.Tensor | None = None,
    importance_cap: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate loss of some sequences, summed with ``weights`` (b, seq_len; 0 off the trained tokens).

    logprobs (b, seq_len): the policy's, with gradient; old_logprobs: the generator's (the ratio's denominator);
    advantages (b,): per sequence; ref_logprobs: the frozen reference's, for ``kl_coef`` * k3 (exp(r - p) - (r - p) - 1,
    an unbiased, non-negative KL estimate). Returns the loss and weighted sums for the records: the fraction of tokens
    whose ratio was clipped, the KL, and the off-policy gap (|policy - generator| log-prob).

    proximal_logprobs (truncated importance sampling, ``importance_cap`` > 0): the trainer's own log-probs at the
    step's start, no gradient. The ratio is then to them, and each token's term is weighted by
    min(exp(proximal - generator), cap): the generator's distribution corrected to the trainer's, its variance capped
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"). Recorded: the share
    of tokens whose weight was capped.
    """
    on = weights > 0
    diff = torch.where(on, logprobs - old_logprobs, 0.0)
    ratio = diff.exp()
    if proximal_logprobs is not None:
        ratio = torch.where(on, logprobs - proximal_logprobs, 0.0).exp()
    adv = advantages[:, None]
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    per_token = torch.maximum(unclipped, clipped)
    capped = None
    if proximal_logprobs is not None:
        behaviour = torch.where(on, proximal_logprobs - old_logprobs, 0.0).exp()
        per_token = per_token * behaviour.clamp(max=importance_cap)
        capped = ((behaviour > importance_cap) & on).float().mul(weights).sum()
    stats = {
        "clip_fraction": ((clipped > unclipped) & on).float().mul(weights).sum().detach(),
        "offpolicy_gap": diff.detach().abs().mul(weights).sum(),
    }
    if capped is not None:
        stats["importance_capped"] = capped
    if ref_logprobs is not None:  # the KL is recorded only with a reference
        delta = torch.where(on, ref_logprobs - logprobs, 0.0)
        kl = delta.exp() - delta - 1.0
        stats["kl"] = kl.detach().mul(weights).sum()
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    return (per_token * weights).sum(), stats


def count_nonfinite_logprobs(batch: UpdateBatch, step: int, *, max_share: float, rollouts_path: str) -> int:
    """The step's completion tokens whose generator log-prob is not finite (the token weights leave them out of the
    loss). Every rank holds the whole step's rollouts (gathered, or read from the same file): every rank counts the
    same, and stops together.

    Raises:
        NonFiniteStep: more than ``max_share`` (rl.max_nonfinite_logprob_share) of them, before the step's update.
    """
    bad, tokens = batch.nonfinite_tokens()
    if bad and bad / tokens > max_share:
        where = f"read from rl.rollouts_path {rollouts_path}" if rollouts_path else "from the in-process generator"
        fix = (
            "fix the engine's log-probs"
            if rollouts_path
            else "resume from the last good checkpoint with a lower optimizer.lr (the policy's logits overflowed)"
        )
        raise NonFiniteStep(
            f"step {step}: {bad} of its {tokens} completion tokens ({bad / tokens:.1%}) have a generator log-prob that "
            f"is not finite (NaN, inf or null; {where}), more than rl.max_nonfinite_logprob_share = {max_share:g}; "
            f"stopped before the step's update, so no checkpoint holds it. {fix[0].upper()}{fix[1:]}, or raise "
            "rl.max_nonfinite_logprob_share (such tokens are left out of the loss)"
        )
    return bad
