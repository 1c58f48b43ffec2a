"""Sampling text from a trained model: greedy, temperature and top-k, with or without a KV cache, or speculative.

The model is not edited: ``KVCache.install`` swaps each block's attention kernel
(``layers[*].attention.sdpa``, the seam context parallel uses too) for one that appends the step's
keys and values to a per-layer cache and attends over everything cached so far. A recurrent layer
(Qwen3.5's Gated DeltaNet: a ``state`` seam, None while training, and ``new_state()``) gets an empty state to
carry its convolution inputs and recurrence from one call to the next. The model gets the
new tokens' true positions (its ``positions`` argument), so RoPE rotates them as in a full forward.
Without the cache every step runs the whole sequence again: the reference the cache is tested against.

Works on the local heads a tensor-parallel rank holds (the kernel reads head counts from shapes).
``speculative.py``: greedy decoding with a DeepSeek-V3 model's multi-token-prediction depths as the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import apply_sinks, masked_attention_with_lse, repeat_kv


class CachedAttention(nn.Module):
    """Causal attention of new queries over cached + new keys/values of one layer.

    ``window``: the replaced kernel's sliding window (gpt-oss: tokens a query sees, itself included), or None.
    Keys and values keep their own head dims (multi-head latent attention: v heads narrower than q/k).
    """

    def __init__(self, cache: KVCache, window: int | None = None):
        super().__init__()
        self.cache, self.window = cache, window
        self.k: torch.Tensor | None = None  # (bs, n_kv_heads, max_len, qk head_dim)
        self.v: torch.Tensor | None = None  # (bs, n_kv_heads, max_len, v head_dim)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q (bs, n_heads, n, head_dim); k, v (bs, n_kv_heads, n, .), the n newest tokens; sinks (n_heads,):
        gpt-oss's per-head logit in the softmax's denominator, or None."""
        start, n = self.cache.length, q.shape[2]
        if self.k is None:
            self.k = k.new_zeros((k.shape[0], k.shape[1], self.cache.max_len, k.shape[3]))
            self.v = v.new_zeros((v.shape[0], v.shape[1], self.cache.max_len, v.shape[3]))
        self.k[:, :, start : start + n] = k
        self.v[:, :, start : start + n] = v
        keys, values = self.k[:, :, : start + n], self.v[:, :, : start + n]  # (bs, n_kv_heads, start+n, .)
        # query i (position start+i) sees keys 0..start+i (the last `window` of them with a window)
        mask = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(diagonal=start)
        if self.window is not None:
            mask &= torch.ones_like(mask).triu(diagonal=start - self.window + 1)
        if sinks is not None:  # gpt-oss's kernel math: explicit scores, then the sink in the denominator
            out, lse = masked_attention_with_lse(q, keys, values, mask)
            return apply_sinks(out, lse, sinks).to(q.dtype)
        keys, values = repeat_kv(keys, values, q.shape[1] // k.shape[1])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class KVCache:
    """Every layer's keys and values for up to ``max_len`` positions; ``length`` of them are filled."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether each of ``model``'s blocks has our attention's kernel seam (``layers[*].attention.sdpa``) or a
        recurrent layer's state seam (``attention.state``): not a transformers model's (``model.name = "hf"``),
        which generates without the cache."""
        layers = getattr(model, "layers", None)
        seams = ("sdpa", "state")
        return layers is not None and all(
            any(hasattr(getattr(b, "attention", None), seam) for seam in seams) for b in layers.values()
        )

    def install(self, model: nn.Module, pad_multiple: int = 1) -> list[tuple[nn.Module, str, object]]:
        """Swap the attention kernels of ``model.layers`` and give each recurrent layer an empty state; returns
        (module, attribute, original) for ``uninstall``."""
        return self.install_blocks(list(model.layers.values()), pad_multiple)

    def install_blocks(self, blocks: list[nn.Module], pad_multiple: int = 1) -> list[tuple[nn.Module, str, object]]:
        """``install`` on these blocks (a block outside ``layers``: a multi-token-prediction depth's has its own cache).

        Raises:
            NotImplementedError: ``pad_multiple`` > 1 (``generate``'s padding) on a model with recurrent layers.
        """
        if pad_multiple > 1 and any(hasattr(b.attention, "state") for b in blocks):
            raise NotImplementedError(
                f"generate with pad_multiple = {pad_multiple} on a model with recurrent layers: padding tokens would "
                "enter their state; generate without tensor parallel's sequence sharding (pad_multiple = 1)"
            )
        swapped: list[tuple[nn.Module, str, object]] = []
        for block in blocks:
            attention = block.attention
            if hasattr(attention, "sdpa"):
                swapped.append((attention, "sdpa", attention.sdpa))
                kernel = attention.sdpa  # a kernel with more to cache (DSA's indexer keys) builds its own twin
                cached = kernel.cached(self) if hasattr(kernel, "cached") else None
                attention.sdpa = cached or CachedAttention(self, window=getattr(kernel, "window", None))
            else:
                swapped.append((attention, "state", attention.state))
                attention.state = attention.new_state()
        return swapped

    @staticmethod
    def uninstall(swapped: list[tuple[nn.Module, str, object]]) -> None:
        for module, attribute, original in swapped:
            setattr(module, attribute, original)


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy (argmax); else softmax(logits / temperature) over the ``top_k`` best (0: all)
    and, with ``top_p`` < 1, the smallest set of the best tokens whose probabilities reach ``top_p`` (nucleus)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the sampling distribution is the softmax of (before top-k/top-p): logits / temperature."""
        return logits if self.temperature <= 0 else logits / self.temperature

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """logits (bs, vocab) fp32 -> (bs,) token ids."""
        if self.temperature <= 0:
            return logits.argmax(dim=-1)
        logits = self.scaled(logits)
        if self.top_k > 0:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (bs, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)  # (bs, vocab)
            probs = ordered.softmax(dim=-1)
            drop_sorted = probs.cumsum(dim=-1) - probs >= self.top_p  # the better ones already reach top_p
            drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # back in vocabulary order
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    use_cache: bool = True,
    stop_token: int | Collection[int] | None = None,
    generator: torch.Generator | None = None,
    logprobs: list[torch.Tensor] | None = None,
    all_done: Callable[[torch.Tensor], bool] | None = None,
    pad_multiple: int = 1,
    steer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """prompt (bs, n) token ids -> (bs, n + generated): the prompt followed by up to ``max_new_tokens``.

    ``stop_token``: one id or several (a chat model's end of turn and its eos). Generation stops early
    once every row has produced one of them; a row that stopped first goes on to the end of the batch's
    generation, so cut each row at its first stop. ``generator`` seeds the sampling.

    ``logprobs``: a list that gets, per generated position, the (bs,) fp32 log-probabilities of the picked
    tokens under ``sampling.scaled`` logits (the policy at the sampling temperature, before top-k/top-p), as
    reinforcement learning's ratio reads them. ``all_done``: (bs,) bool "row has stopped" -> stop now; ranks
    that each generate their own rows under FSDP or TP must stop together, so they agree here (default: every
    row of this batch).

    ``pad_multiple``: with the cache, each forward's new tokens are padded on the right to a multiple of this
    (tensor parallel's sequence parallel shards the sequence over the tp ranks: a 1-token step would leave a rank
    none). Padding is harmless: no real token attends to a later one, and the next step overwrites its cache slots.

    ``steer``: the sampled (bs,) ids -> (the ids to append, (bs,) bool "row is done"), in place of the stop test:
    RL's multi-turn episodes force an environment's reply into a row, one token a step (the cache and the ranks'
    agreement hold).
    """
    tokens = prompt
    cache = KVCache(prompt.shape[1] + max_new_tokens + pad_multiple - 1) if use_cache else None
    swapped = cache.install(model, pad_multiple) if cache is not None else []
    if steer is None:
        steer = _stop_test(_stop_ids(stop_token, prompt.device), prompt.shape[0])
    try:
        for _ in range(max_new_tokens):
            if cache is None:  # the whole sequence again, positions 0..len-1
                logits = model(tokens)[:, -1]
            else:
                logits = _forward_new(model, tokens, cache, pad_multiple)
            logits = _full(logits).float()  # (bs, vocab)
            nxt = sampling.pick(logits, generator)  # (bs,)
            if steer is not None:
                nxt, done = steer(nxt)
            if logprobs is not None:
                scaled = sampling.scaled(logits).log_softmax(dim=-1)
                logprobs.append(scaled.gather(-1, nxt[:, None]).squeeze(-1))
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            if steer is not None and (all_done(done) if all_done is not None else bool(done.all())):
                break
    finally:
        KVCache.uninstall(swapped)
    return tokens


def _forward_new(model: nn.Module, tokens: torch.Tensor, cache: KVCache, pad_multiple: int) -> torch.Tensor:
    """The last new token's logits (bs, vocab), forwarding only the tokens not yet cached, at their true positions."""
    new = tokens[:, cache.length :]
    n = new.shape[1]
    if n % pad_multiple:  # repeat the last token into the padding
        new = torch.cat([new, new[:, -1:].expand(-1, pad_multiple - n % pad_multiple)], dim=1)
    positions = torch.arange(cache.length, cache.length + new.shape[1], device=tokens.device)
    logits = model(new, positions)[:, n - 1]
    cache.length = tokens.shape[1]
    return logits


def _stop_test(
    stops: torch.Tensor | None, bs: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """``generate``'s default ``steer``: the sampled ids unchanged, a row done once it has produced a stop id."""
    if stops is None:
        return None
    done = torch.zeros(bs, dtype=torch.bool, device=stops.device)

    def test(nxt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        done.logical_or_(torch.isin(nxt, stops))
        return nxt, done

    return test


def _stop_ids(stop_token: int | Collection[int] | None, device: torch.device) -> torch.Tensor | None:
    """``generate``'s stop ids as a tensor (None: no stop; an empty collection is none too)."""
    if stop_token is None:
        return None
    ids = [stop_token] if isinstance(stop_token, int) else list(stop_token)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def _full(logits: torch.Tensor) -> torch.Tensor:
    """Plain logits (a replicated DTensor under tensor parallel without loss parallel)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits
