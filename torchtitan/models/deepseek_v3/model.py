"""DeepSeek-V3 (and Kimi K2, DeepSeek-V2-Lite's shapes): multi-head latent attention with MoE feed-forwards.

A plain nn.Module in llama's layout, so the parallelisms that transform llama's modules apply:
``tok_embeddings``, ``layers`` (a ModuleDict "0".."N-1"), ``norm``, ``output`` (each may be None on a
pipeline stage); each block has ``attention_norm``, ``attention`` (``MLAttention``), ``ffn_norm`` and
``feed_forward``: llama's FeedForward (width ``ffn_dim``) on the first ``first_k_dense`` layers, the
MoE of models/moe elsewhere (sigmoid scores, expert bias, group-limited top-k, shared expert), so
expert parallel, FSDP and the load balancer apply unchanged.

MLA (DeepSeek-V2): q comes from x directly (``wq``) or through a low-rank bottleneck (``wq_a`` ->
RMSNorm ``q_norm`` -> ``wq_b``); k and v come from one compressed latent per token (``wkv_a`` ->
RMSNorm ``kv_norm`` -> ``wkv_b``, per head k_nope and v) plus a RoPE part shared by every head
(the rest of ``wkv_a``'s output). RoPE rotates the last ``qk_rope_head_dim`` dims of q and k as
interleaved pairs, the layout of DeepSeek's weights (transformers' ``rope_interleave = True``), so
the weights import without reordering. Heads are read from shapes (``view(bs, seqlen, -1, d)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.common.mtp import build_mtp, mtp_ahead, mtp_logits
from torchtitan.models.common.rope.yarn import compute_yarn_rope_cache
from torchtitan.models.deepseek_v3.args import DeepSeekV3Args, softmax_scale_multiplier
from torchtitan.models.llama.model import (
    CausalAttention,
    FeedForward,
    TransformerBlock,
    apply_rotary_emb,
    build_norm,
    compute_rope_cache,
)
from torchtitan.models.moe import MoE, MoETransformer

# DeepSeek's q and kv latent norms use a fixed eps (transformers' too), whatever the model's norm_eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention; the kernel is llama's ``CausalAttention`` (``self.sdpa``), so context
    parallel and document masking, which swap or extend that module, apply. q/k heads are
    ``qk_nope_head_dim + qk_rope_head_dim`` wide and v heads ``v_head_dim``: the kernel gets both."""

    def __init__(self, args: DeepSeekV3Args):
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim, self.kv_lora_rank = args.qk_head_dim, args.v_head_dim, args.kv_lora_rank
        q_out = args.n_heads * args.qk_head_dim
        self.wq: nn.Linear | None = nn.Linear(args.dim, q_out, bias=False) if args.q_lora_rank == 0 else None
        self.wq_a: nn.Linear | None = None
        self.q_norm: nn.RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank > 0:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.sdpa: nn.Module = CausalAttention(args.attention_backend)
        # The kernel scales by qk_head_dim^-0.5; MLA's scale is that times YaRN's mscale^2 (1 without
        # YaRN), so q is pre-multiplied by the rest and every kernel (CP's included) stays as it is.
        self.q_scale = softmax_scale_multiplier(args.rope_scaling)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                trunc_normal_(linear.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()

    def qkv(
        self, x: torch.Tensor, q: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (bs, seqlen, dim) and its query projection q (bs, seqlen, n_heads * qk_head_dim) -> q, k, v
        (bs, n_heads, seqlen, .): RoPE on q's and the one shared k's rope dims, k and v expanded from the latent."""
        bs, seqlen, _ = x.shape
        # -1: the local head count, which tensor parallel divides by the TP degree.
        q = q.view(bs, seqlen, -1, self.qk_head_dim)  # (bs, seqlen, n_heads, qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # latent (bs, seqlen, kv_lora_rank); k_pe (bs, seqlen, qk_rope_head_dim), one for every head
        rope = rope[..., :seqlen, :]  # sliced here, where the sequence is whole
        q_pe = apply_rotary_emb(q_pe, rope)  # (bs, seqlen, n_heads, qk_rope_head_dim)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), rope)  # (bs, seqlen, 1, qk_rope_head_dim)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (bs, seqlen, n_heads, .)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (bs, seqlen, n_heads, qk_head_dim)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # like q
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (bs, n_heads, seqlen, .)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (bs, seqlen, dim); rope ([bs,] >= seqlen, qk_rope_head_dim), row i for the i-th token of x;
        doc_ids (bs, seqlen) or None: see CausalAttention."""
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q, k, v = self.qkv(x, q, rope)
        out = self.sdpa(q, k, v) if doc_ids is None else self.sdpa(q, k, v, doc_ids=doc_ids)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))  # (bs, seqlen, dim)


def build_deepseek_v3_block(layer_id: int, args: DeepSeekV3Args) -> TransformerBlock:
    """Llama's pre-norm block with MLA; ``feed_forward`` llama's FeedForward (width ``ffn_dim``) on the
    first ``first_k_dense`` layers, an MoE after them."""
    feed_forward = MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args, hidden=args.ffn_dim)
    return TransformerBlock(layer_id, args, feed_forward=feed_forward, attention=MLAttention(args))


class DeepSeekV3Transformer(MoETransformer):
    """llama's MoE Transformer (embedding, norm, output, init units, forward, load balancing) with
    DeepSeek-V3 blocks and a RoPE table of ``qk_rope_head_dim`` (YaRN-scaled); with ``mtp_layers``, the
    multi-token-prediction depths ``mtp`` ("0".."D-1", models/common/mtp.py), None on a model without them."""

    output_modules = ("norm", "output", "mtp")  # the depths read the head they share: on the last pipeline stage

    def __init__(
        self,
        args: DeepSeekV3Args,
        build_block: Callable[[int, DeepSeekV3Args], TransformerBlock] = build_deepseek_v3_block,
    ):
        """``build_block(layer_id, args)`` builds the layers and each MTP depth's block (DeepSeek-V3.2: DSA's)."""
        super().__init__(args, build_block=build_block)
        self.mtp = build_mtp(
            args.mtp_layers,
            args.dim,
            args.n_layers,
            lambda layer_id: build_block(layer_id, args),
            lambda: build_norm(args.norm_type, args.dim, args.norm_eps),
        )
        for module in self.mtp.modules() if self.mtp is not None else ():
            if isinstance(module, CausalAttention):
                module.documents = self.document_cache

    def _rope_cache(self) -> torch.Tensor:
        """(max_seq_len, qk_rope_head_dim): [cos | sin] of each position's angles (times YaRN's attention factor)."""
        args = self.args
        if args.rope_scaling is None:
            return compute_rope_cache(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta)
        return compute_yarn_rope_cache(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)

    def init_units(self) -> Iterator[tuple[str, Callable[[], None]]]:
        """llama's units, then each MTP depth ("mtp.0", ...): seeded by name, so the model's own init does not
        depend on whether it has MTP depths."""
        yield from super().init_units()
        for name, depth in self.mtp.items() if self.mtp is not None else ():
            yield f"mtp.{name}", depth.init_weights

    def moe_layers(self) -> dict[str, MoE]:
        """MoETransformer's, plus each MTP depth's MoE under its published layer number (n_layers + k)."""
        layers = super().moe_layers()
        for name, depth in self.mtp.items() if self.mtp is not None else ():
            layers.update({str(self.args.n_layers + int(name)): m for m in depth.modules() if isinstance(m, MoE)})
        return layers

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        *ahead: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        return_hidden: bool = False,
        mtp: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """llama's forward; ``mtp`` (training with MTP depths): the logits (bs, (1 + D) * seqlen, vocab), the model's
        then each depth's (depth k predicts token i+k+1 at position i) concatenated on the sequence dim.

        A part without the output head (a pipeline stage before the last; the depths live with the head) returns,
        with ``mtp``, (hidden (bs, seqlen, dim), *ahead): the depths' embedded tokens ``ahead`` (D of (bs, seqlen,
        dim), ``mtp_ahead``) computed where the embedding table is and handed on to the part holding the depths,
        so the table has no copy there and its gradient comes back the same way. A later part receives them as the
        pipeline hands a stage its predecessor's outputs, positionally after the hidden state: the first lands in
        ``positions``' place, told apart by its dtype (positions are integers, the embedded tokens floating)."""
        if positions is not None and positions.is_floating_point():
            positions, ahead = None, (positions, *ahead)
        if ahead and not mtp:
            raise TypeError(
                f"{type(self).__name__}.forward: {len(ahead)} embedded tensors after the tokens without mtp"
            )
        if not mtp or self.args.mtp_layers == 0:
            return super().forward(tokens, positions, doc_ids=doc_ids, return_hidden=return_hidden)
        if self.tok_embeddings is not None:  # (bs, seqlen) tokens: the whole model, or the first of its parts
            ahead = mtp_ahead(tokens, self.tok_embeddings, self.args.mtp_layers)
        h = super().forward(tokens, positions, doc_ids=doc_ids, return_hidden=True)  # (bs, seqlen, dim)
        if self.output is None:
            return (h, *ahead)
        rope = self.rope_at(positions)
        depths = mtp_logits(self.mtp, h, ahead, output=self.output, rope=rope, doc_ids=doc_ids)
        return torch.cat([self.output(h), *depths], dim=1)  # (bs, (1 + D) * seqlen, vocab)
