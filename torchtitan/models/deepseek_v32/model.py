"""DeepSeek-V3.2 ("deepseek_v32"): DeepSeek-V3's model with DeepSeek Sparse Attention in every layer.

Each block's attention is MLA (deepseek_v3/model.py) whose kernel seam (``attention.sdpa``) is DSA's
``SparseAttention`` (indexer.py): the block's lightning indexer (``attention.indexer``) reads the block's input and
the q bottleneck's normed latent, scores every causal key, and each query attends to its ``index_topk`` best. The
indexer reads its inputs detached, so the LM loss trains everything but the indexers and the indexer loss
(``indexer_loss()``, added by the trainer as MoE's aux loss is) trains only them. In the dense warm-up stage
(``dsa_stage = "dense_warmup"``) attention is dense and every parameter but the indexers' is frozen.
"""

from __future__ import annotations

import torch
from torch import nn

from torchtitan.models.deepseek_v3.model import DeepSeekV3Transformer, MLAttention
from torchtitan.models.deepseek_v32.args import DeepSeekV32Args
from torchtitan.models.deepseek_v32.indexer import Indexer, SparseAttention
from torchtitan.models.llama.model import FeedForward, TransformerBlock
from torchtitan.models.moe import MoE


class _RequireGrad(torch.autograd.Function):
    """``x`` unchanged, with a graph through ``anchor`` that passes no gradient to it.

    In the dense warm-up a block's own parameters are frozen, so without it the logits would carry no graph and the
    step's backward of the LM loss (with the indexer loss) fails ("element 0 of tensors does not require grad",
    measured on the FSDP2 row); with it the backward runs through every block as in training, so FSDP's hooks on
    each unit's output gather the block for its indexer's backward and reduce its gradients in order. The LM loss
    passes no gradient into the indexer through here: the indexer learns from its own loss only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class DSAttention(MLAttention):
    """MLA with DSA: the lightning indexer picks each query's keys (``SparseAttention``, the kernel seam that
    generation's KV cache swaps for its cached twin)."""

    def __init__(self, args: DeepSeekV32Args):
        super().__init__(args)
        self.indexer = Indexer(args)
        self.sdpa: nn.Module = SparseAttention(args.index_topk, args.dsa_stage)
        self.dense_warmup = args.dsa_stage == "dense_warmup"

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.indexer.init_weights()

    def forward(self, x: torch.Tensor, rope: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x (bs, seqlen, dim); rope ([bs,] >= seqlen, qk_rope_head_dim); doc_ids (bs, seqlen) or None."""
        bs, seqlen, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))  # (bs, seqlen, q_lora_rank)
        q, k, v = self.qkv(x, self.wq_b(q_latent), rope)  # (bs, n_heads, seqlen, .)
        # detached: the indexer learns from its own loss only, and the LM loss never reaches it
        index = self.indexer(
            x.detach(), q_latent.detach(), rope[..., :seqlen, :]
        )  # (bs, seqlen, heads, d), (bs, seqlen, d), w
        out = self.sdpa(q, k, v, index) if doc_ids is None else self.sdpa(q, k, v, index, doc_ids=doc_ids)
        out = self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))  # (bs, seqlen, dim)
        loss = getattr(self.sdpa, "indexer_loss", None)
        if self.dense_warmup and loss is not None and loss.requires_grad and not out.requires_grad:
            out = _RequireGrad.apply(out, loss)
        return out


def build_deepseek_v32_block(layer_id: int, args: DeepSeekV32Args) -> TransformerBlock:
    """DeepSeek-V3's block with DSA's attention."""
    feed_forward = MoE(args) if args.is_moe_layer(layer_id) else FeedForward(args, hidden=args.ffn_dim)
    return TransformerBlock(layer_id, args, feed_forward=feed_forward, attention=DSAttention(args))


class DeepSeekV32Transformer(DeepSeekV3Transformer):
    """DeepSeek-V3's Transformer with DSA blocks; ``indexer_loss()`` the indexers' loss of the last forward."""

    def __init__(self, args: DeepSeekV32Args):
        super().__init__(args, build_block=build_deepseek_v32_block)  # MTP depths (mtp_layers) of DSA blocks too
        if args.dsa_stage == "dense_warmup":  # the paper's warm-up: only the indexers train
            for name, param in self.named_parameters():
                param.requires_grad_(".attention.indexer." in f".{name}")

    def indexer_loss(self) -> torch.Tensor:
        """``indexer_loss_coeff`` times the sum over this module's layers of their indexer losses of the last
        training forward, taken (a second call before the next forward returns 0). The MTP depths' blocks count: a
        training forward with them runs their indexers too."""
        kernels = [m for m in self.modules() if isinstance(m, SparseAttention)]  # inside AC/FSDP wrappers
        losses = [s.indexer_loss for s in kernels if s.indexer_loss is not None]
        for s in kernels:
            s.indexer_loss = None
        if not losses:
            return torch.zeros((), device=self.rope_cache.device)
        return self.args.indexer_loss_coeff * torch.stack(losses).sum()
