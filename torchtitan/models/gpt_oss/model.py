"""gpt-oss (OpenAI's open-weight MoE models, ``GptOssForCausalLM``). A plain nn.Module, llama's layout.

Blocks are llama's shape (``attention_norm``, ``attention`` with ``wq``/``wk``/``wv``/``wo``, ``ffn_norm``,
``feed_forward``) so the parallelisms that walk llama's names apply; what differs:

* attention: biased projections, grouped-query heads, a learned logit per head (``sinks``) that joins
  every softmax denominator, and a sliding window on alternating layers (``GptOssArgs.layer_window``);
* the feed-forward is an MoE on every layer (moe.py): a biased router, clamped-SwiGLU experts with biases;
* YaRN RoPE, whose attention scaling is folded into the cos/sin table.

Heads are read from tensor shapes (``view(bs, seqlen, -1, head_dim)``) and the sinks through ``local_part``
(a tensor-parallel plan shards them over heads, Shard(0), like wq's output), so the model imports nothing
distributed. The attention kernel is one module (``attention.sdpa``), swappable like llama's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.common.attention import apply_sinks, masked_attention_with_lse
from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.common.local import local_part
from torchtitan.models.common.rope.yarn import compute_yarn_rope_cache
from torchtitan.models.gpt_oss.args import GptOssArgs
from torchtitan.models.gpt_oss.moe import GptOssMoE
from torchtitan.models.llama.model import Attention, TransformerBlock, compute_rope_cache
from torchtitan.models.moe.model import MoETransformer


def attention_mask(seqlen: int, window: int | None, doc_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(sq, sk) or (bs, 1, sq, sk) bool, True = visible: causal, within ``window`` tokens (query k sees key j when
    k - window < j <= k, transformers' ``sliding_window_overlay``), and in the same document when ``doc_ids``."""
    q = torch.arange(seqlen, device=device)[:, None]
    k = torch.arange(seqlen, device=device)[None, :]
    visible = k <= q if window is None else (k <= q) & (k > q - window)  # (sq, sk)
    if doc_ids is None:
        return visible
    return visible & (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1)  # (bs, 1, sq, sk)


class SinkAttention(nn.Module):
    """The kernel of one layer: causal (sliding-window) attention with sinks, block-causal over ``doc_ids``.

    A module so that context parallel can swap in a ring kernel with the same call, one that masks its blocks
    with this layer's ``window``, merges their (out, lse) and applies ``apply_sinks`` once at the end.
    """

    def __init__(self, window: int | None):
        super().__init__()
        self.window = window  # tokens a query sees (itself included); None: the whole causal context

    def extra_repr(self) -> str:
        return f"window={self.window}"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q (bs, n_heads, s, head_dim); k, v (bs, n_kv_heads, s, head_dim); sinks (n_heads,); doc_ids (bs, s) -> like q."""
        mask = attention_mask(q.shape[2], self.window, doc_ids, q.device)
        out, lse = masked_attention_with_lse(q, k, v, mask)
        return apply_sinks(out, lse, sinks).to(q.dtype)


class GptOssAttention(Attention):
    """Llama's attention with biases on q/k/v/o, a learned sink logit per query head, and the layer's window."""

    def __init__(self, layer_id: int, args: GptOssArgs):
        super().__init__(args, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))  # one logit per query head
        self.sdpa = SinkAttention(args.layer_window(layer_id))

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        trunc_normal_(self.sinks, mean=0.0, std=0.02)  # transformers: normal(0, initializer_range)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        sinks = local_part(self.sinks)  # (local n_heads,): this rank's heads under TP
        return self.sdpa(q, k, v, sinks) if doc_ids is None else self.sdpa(q, k, v, sinks, doc_ids=doc_ids)


def build_gpt_oss_block(layer_id: int, args: GptOssArgs) -> TransformerBlock:
    """Llama's pre-norm block with gpt-oss's attention (sinks, the layer's window) and MoE."""
    return TransformerBlock(layer_id, args, feed_forward=GptOssMoE(args), attention=GptOssAttention(layer_id, args))


class GptOssTransformer(MoETransformer):
    """llama's MoE Transformer (embedding, norm, output, init units, forward, load balancing) with gpt-oss
    blocks and YaRN RoPE."""

    def __init__(self, args: GptOssArgs, build_block: Callable[[int, GptOssArgs], nn.Module] = build_gpt_oss_block):
        super().__init__(args, build_block=build_block)

    def _rope_cache(self) -> torch.Tensor:
        args = self.args
        if args.yarn is None:
            return compute_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta)
        return compute_yarn_rope_cache(args.head_dim, args.max_seq_len, args.rope_theta, args.yarn)
