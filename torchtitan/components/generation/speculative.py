"""Greedy self-speculative decoding: a DeepSeek-V3 model's multi-token-prediction (MTP) depths draft, the model checks.

After the model's forward over the accepted tokens, depth 1 reads its last hidden state and the embedding of the
token just chosen and drafts the token after it; depth k reads depth k-1's hidden state and depth k-1's draft (the
chain of models/common/mtp.py, at position L-1: depth k predicts token L+k). The model then runs once over
[chosen token, drafts...] with its KV cache and keeps the longest prefix of drafts equal to its own argmax, plus its
argmax after that prefix: every step adds 1 to D + 1 tokens, each the model's own greedy choice, so the output is
plain greedy decoding's.

Each depth's block attends over that depth's earlier positions, so it has a KV cache of its own
(``KVCache.install_blocks``). Depth k's entry at position j is built from token j+k and depth k-1's hidden state
at j: right once token j+k is accepted, so its cache ``length`` is L-k+1 after each step (positions 0..L-k), and
the positions past it, built from drafts, are written again on the next step; the same for the model's cache,
rolled back to the accepted tokens. Batch size 1; the model is not edited (the cache's seams and a forward hook on
``model.norm``, whose output is the final-normed hidden state the depths were trained on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan.components.generation import KVCache, _full
from torchtitan.models.common.mtp import builds_mtp

FLAG = "--speculative mtp"


@dataclass(frozen=True)
class SpeculativeStats:
    """What a run generated (tokens after the prompt), how many tokens the depths drafted and how many the model
    accepted, and its wall time (prompt included)."""

    generated: int
    drafted: int
    accepted: int
    seconds: float

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"speculative mtp: {self.generated} tokens, {self.drafted} drafted, {self.accepted} accepted "
            f"(acceptance {self.acceptance:.2f}), {self.tokens_per_s:.1f} tokens/s"
        )


def check_speculative_settings(*, temperature: float, top_k: int, use_cache: bool, world_size: int) -> None:
    """Refuse what speculative decoding here does not do, in one line each.

    Raises:
        ValueError: sampling (temperature or top-k), or no KV cache.
        NotImplementedError: several ranks.
    """
    if temperature > 0 or top_k > 0:
        raise ValueError(
            f"{FLAG} with --temperature {temperature} --top_k {top_k}: speculative decoding is greedy only (allowed: "
            "--temperature 0 --top_k 0); drop --temperature/--top_k, or drop --speculative"
        )
    if not use_cache:
        raise ValueError(
            f"{FLAG} with --no_cache: the drafts are checked over the KV cache (allowed: the cache); drop --no_cache"
        )
    if world_size > 1:
        raise NotImplementedError(
            f"{FLAG} on {world_size} ranks: not built (batch size 1, one process); run it without torchrun"
        )


def mtp_depths(model: nn.Module) -> nn.ModuleDict:
    """The model's MTP depths ("0".."D-1").

    Raises:
        ValueError: a family that builds none, or a model built without them.
    """
    args = getattr(model, "args", None)
    if not builds_mtp(args):
        raise ValueError(
            f"{FLAG} with a {type(model).__name__} model: its family builds no multi-token-prediction depths "
            "(allowed: a family whose model.mtp_layers builds them, docs/models.md); drop --speculative"
        )
    if model.mtp is None:
        raise ValueError(
            f"{FLAG}: this model has no multi-token-prediction depths (mtp_layers = {args.mtp_layers}; allowed: >= 1); "
            "pass a checkpoint trained with --model.mtp_layers N, or an --hf folder whose config.json has "
            "num_nextn_predict_layers and which holds those layers' weights "
            "(model.layers.{num_hidden_layers}.eh_proj, ...)"
        )
    return model.mtp


class MtpDrafter:
    """The depths under their own KV caches, and each depth's hidden states (depth 0: the model's) by position."""

    def __init__(self, model: nn.Module, max_len: int):
        self.model, self.depths = model, list(mtp_depths(model).values())
        self.caches = [KVCache(max_len) for _ in self.depths]
        weight = model.tok_embeddings.weight  # (vocab, dim)
        self.hidden = [weight.new_zeros(1, max_len, weight.shape[1]) for _ in range(len(self.depths) + 1)]

    def install(self) -> list[tuple[nn.Module, str, object]]:
        return [s for depth, cache in zip(self.depths, self.caches) for s in cache.install_blocks([depth.block])]

    def draft(self, tokens: torch.Tensor, m: int) -> torch.Tensor:
        """tokens (1, L+1): the accepted tokens, the last one chosen but not yet through the model (whose hidden
        states 0..L-1 are in ``hidden[0]``) -> (m,) drafts of tokens L+1..L+m from depths 1..m."""
        n_accepted = tokens.shape[1] - 1  # L
        seq = tokens[0]  # (L+1,), then the drafts as they come
        for k, (depth, cache) in enumerate(zip(self.depths[:m], self.caches[:m]), start=1):
            start = cache.length  # depth k's positions < start are right; start..L-1 are (re)computed now
            positions = torch.arange(start, n_accepted, device=tokens.device)
            ahead = seq[start + k : n_accepted + k][None]  # (1, L-start): token j+k at position j
            embedded = self.model.tok_embeddings(ahead)  # (1, L-start, dim)
            h = depth(self.hidden[k - 1][:, start:n_accepted], embedded, self.model.rope_at(positions))  # like it
            self.hidden[k][:, start:n_accepted] = h
            cache.length = max(0, n_accepted - k + 1)  # position j is right where token j+k is accepted (j + k <= L)
            # (1, vocab): token L+k; a padded table's extra rows may win here, and the model then rejects them
            logits = self.model.output(depth.norm(h[:, -1]))
            seq = torch.cat([seq, logits.argmax(dim=-1)])
        return seq[n_accepted + 1 :]


@torch.no_grad()
def generate_speculative(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    stop_token: Collection[int] = (),
    edit_drafts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, SpeculativeStats]:
    """prompt (1, n) -> ((1, n + generated) tokens, stats): greedy decoding, with the MTP depths as the draft.

    Stops after ``max_new_tokens`` or at the first of ``stop_token``. ``edit_drafts`` (tests): (accepted tokens
    (1, L+1), the depths' drafts (m,)) -> the drafts the model checks.

    Raises:
        ValueError: a batch of several rows, or a model without MTP depths.
    """
    if prompt.shape[0] != 1:
        raise ValueError(f"{FLAG} with a batch of {prompt.shape[0]} prompts: allowed: 1; generate one at a time")
    began = time.perf_counter()
    max_len = prompt.shape[1] + max_new_tokens
    drafter, cache, seen = MtpDrafter(model, max_len), KVCache(max_len), []
    swapped = cache.install(model) + drafter.install()
    hook = model.norm.register_forward_hook(lambda _module, _args, out: seen.append(out))
    stops = torch.tensor(list(stop_token), dtype=torch.long, device=prompt.device)
    tokens, drafted, accepted = prompt, 0, 0
    try:
        while tokens.shape[1] < max_len and not torch.isin(tokens[0, prompt.shape[1] :], stops).any():
            left = max_len - tokens.shape[1]  # tokens still allowed: the checked step adds up to m + 1
            drafts = drafter.draft(tokens, min(len(drafter.depths), left - 1)) if cache.length else tokens[0, :0]
            if edit_drafts is not None and drafts.numel():
                drafts = edit_drafts(tokens, drafts)
            new = _check(model, tokens, drafts, cache, drafter.hidden[0], seen)
            tokens = torch.cat([tokens, new[None]], dim=1)
            drafted, accepted = drafted + drafts.numel(), accepted + new.numel() - 1
    finally:
        hook.remove()
        KVCache.uninstall(swapped)
    tokens = _cut_at_stop(tokens, prompt.shape[1], stops)
    stats = SpeculativeStats(tokens.shape[1] - prompt.shape[1], drafted, accepted, time.perf_counter() - began)
    return tokens, stats


def _check(
    model: nn.Module, tokens: torch.Tensor, drafts: torch.Tensor, cache: KVCache, hidden: torch.Tensor, seen: list
) -> torch.Tensor:
    """One forward of the model over the tokens it has not cached, then ``drafts`` (m,) -> the (a + 1,) tokens it
    accepts: the first a drafts, equal to its argmax, and its argmax after them. Keeps the hidden states of those
    positions and rolls the cache back to them. (The first call, with no drafts, is the prompt's forward.)"""
    start = cache.length
    new = torch.cat([tokens[0, start:], drafts])[None]  # (1, n): at positions start..start+n-1
    logits = model(new, positions=torch.arange(start, start + new.shape[1], device=tokens.device))
    greedy = _full(logits)[0, -drafts.numel() - 1 :].float().argmax(dim=-1)  # (m+1,)
    agree = (greedy[:-1] == drafts).long().cumprod(dim=0)
    a = int(agree.sum())
    hidden[:, start : tokens.shape[1] + a] = seen.pop()[:, : new.shape[1] - drafts.numel() + a]
    cache.length = tokens.shape[1] + a  # the chosen token and the a accepted drafts; the rest are overwritten later
    return torch.cat([drafts[:a], greedy[a : a + 1]])


def _cut_at_stop(tokens: torch.Tensor, n_prompt: int, stops: torch.Tensor) -> torch.Tensor:
    """(1, len) -> up to and including the first stop id after the prompt (a checked step may run past it)."""
    hits = torch.isin(tokens[0, n_prompt:], stops).nonzero()
    return tokens if not hits.numel() else tokens[:, : n_prompt + int(hits[0]) + 1]
