"""DeepSeek-V4 ("deepseek_v4"). A plain nn.Module with llama's outer layout (``tok_embeddings``, ``layers`` keyed
"0".."N-1", ``norm``, ``output``) and its own blocks:

* the residual is ``hc_mult`` streams (bs, n, hc, dim): the embedding is copied into each, every sub-block reads
  and writes them through a hyper-connection (hyper.py), and ``hc_head`` collapses them before the final norm;
* attention (attention.py): sliding-window shared-KV attention with sinks, plus compressed entries on the
  compressed-sparse and heavily-compressed layers (``layer_types``);
* the feed-forward is an MoE on every layer (moe.py): hash-routed by token id or top-k (``mlp_layer_types``).

Two RoPE tables, one buffer (2, max_seq_len, rope_dim): the sliding layers' (``rope_theta``) and the compressed
layers' (``compress_rope_theta``, optionally YaRN). The norms run in fp32 as transformers' (weights kept fp32 there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchtitan.models.common.rope.yarn import compute_yarn_rope_cache
from torchtitan.models.deepseek_v4.args import HASH_MOE, DeepSeekV4Args
from torchtitan.models.deepseek_v4.attention import V4Attention, rms_norm_fp32
from torchtitan.models.deepseek_v4.hyper import HyperConnection, HyperHead
from torchtitan.models.deepseek_v4.moe import V4MoE
from torchtitan.models.llama.model import compute_rope_cache
from torchtitan.models.moe.model import MoETransformer


class V4Block(nn.Module):
    """Attention then MoE, each between a hyper-connection's collapse and spread of the streams."""

    def __init__(self, layer_id: int, args: DeepSeekV4Args):
        super().__init__()
        self.attention = V4Attention(layer_id, args)
        self.feed_forward = V4MoE(args, hashed=args.mlp_layer_types[layer_id] == HASH_MOE)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attn_hc = HyperConnection(args)
        self.ffn_hc = HyperConnection(args)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for hc in (self.attn_hc, self.ffn_hc):
            hc.init_weights()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)

    def forward(
        self, h: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """h (bs, n, hc, dim) streams; rope (2, max_len, rope_dim); positions (n,); tokens (bs, n) ids (hash
        routing) -> (bs, n, hc, dim)."""
        post, comb, x = self.attn_hc(h)  # (bs, n, hc), (bs, n, hc, hc), (bs, n, dim)
        out = self.attention(rms_norm_fp32(self.attention_norm, x), rope, positions)  # (bs, n, dim)
        h = _spread(post, comb, out, h)
        post, comb, x = self.ffn_hc(h)
        return _spread(post, comb, self.feed_forward(rms_norm_fp32(self.ffn_norm, x), tokens), h)


def _spread(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The sub-block's output spread over the streams (post) plus the streams mixed (stream j feeds k by
    comb[j, k]) -> (bs, n, hc, dim)."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ h


class DeepSeekV4Transformer(MoETransformer):
    """llama's MoE Transformer (embedding, norm, output, init units, load balancing) with V4's blocks, streams
    and two RoPE tables. ``hc_head`` may be None (pipeline stages that do not own the output)."""

    output_modules = ("hc_head", "norm", "output")  # the streams collapse just before the final norm

    @staticmethod
    def hidden_dims(args: DeepSeekV4Args) -> tuple[int, ...]:
        """Between blocks the residual is ``hc_mult`` streams: (hc, dim) after (bs, n)."""
        return (args.hc_mult, args.dim)

    def __init__(self, args: DeepSeekV4Args, build_block: Callable[[int, DeepSeekV4Args], nn.Module] = V4Block):
        super().__init__(args, build_block=build_block)
        self.hc_head: HyperHead | None = HyperHead(args)

    def _rope_cache(self) -> torch.Tensor:
        a = self.args
        main = compute_rope_cache(a.rope_dim, a.max_seq_len, a.rope_theta)  # (max_len, rope_dim)
        if a.compress_yarn is None:
            compress = compute_rope_cache(a.rope_dim, a.max_seq_len, a.compress_rope_theta)
        else:
            compress = compute_yarn_rope_cache(a.rope_dim, a.max_seq_len, a.compress_rope_theta, a.compress_yarn)
        return torch.stack([main, compress])  # (2, max_len, rope_dim)

    def init_units(self) -> Iterator[tuple[str, Callable[[], None]]]:
        for name, init in super().init_units():
            if name == "norm" and self.hc_head is not None:
                yield "hc_head", self.hc_head.init_weights
            yield name, init

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, *, return_hidden: bool = False
    ) -> torch.Tensor:
        """tokens (bs, n) -> logits (bs, n, vocab); on a later pipeline stage, streams (bs, n, hc, dim) -> streams.

        positions (n,): the tokens' positions, consecutive and ending the context (generation's cached steps);
        default 0..n-1. return_hidden: the normed hidden state (bs, n, dim), without ``output``.
        """
        embedded = self.tok_embeddings is None or tokens.is_floating_point()
        if embedded:
            h, ids = tokens, None  # (bs, n, hc, dim)
        else:
            h, ids = self.tok_embeddings(tokens).unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous(), tokens
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, ids)
        if self.hc_head is None:
            return h
        h = rms_norm_fp32(self.norm, self.hc_head(h)) if self.norm is not None else self.hc_head(h)
        if return_hidden:
            return h  # (bs, n, dim)
        return self.output(h) if self.output is not None else h  # (bs, n, vocab)
