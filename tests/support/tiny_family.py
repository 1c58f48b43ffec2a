"""A model family defined entirely outside the package ("tiny_parallel"), registered when this module is imported.

It shows that adding a family needs only its own modules, flavors and spec plus one registration
(tests/distributed/test_model_family.py trains it).

"tiny_parallel": GPT-J-style blocks whose attention and feed-forward each read the block input
and add to the residual in parallel, and a GELU-gated feed-forward. It keeps the trainer's module-name contract (``tok_embeddings``, ``layers``,
``norm``, ``output``; ``attention.{wq,wk,wv,wo}``, ``feed_forward.{w1,w2,w3}``,
``attention_norm``/``ffn_norm``) so the default parallelize (TP plan, FSDP units) and pipeline
split apply unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.llama.model import Attention, build_norm, compute_rope_cache
from torchtitan.spec import ModelSpec, register_model_spec


@dataclass(frozen=True)
class TinyArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 2048
    ffn_hidden: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64
    norm_type: str = "rmsnorm"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class GeGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))


class ParallelBlock(nn.Module):
    """h = x + attention(norm_a(x)) + feed_forward(norm_f(x)): both branches read the block input."""

    def __init__(self, args: TinyArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = GeGLU(args.dim, args.ffn_hidden)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        for linear in (*self.attention.children(), *self.feed_forward.children()):
            if isinstance(linear, nn.Linear):
                nn.init.normal_(linear.weight, std=0.02)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x), rope) + self.feed_forward(self.ffn_norm(x))


class TinyParallelModel(nn.Module):
    def __init__(self, args: TinyArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.layers = nn.ModuleDict({str(i): ParallelBlock(args) for i in range(args.n_layers)})
        self.norm: nn.Module | None = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def _rope_cache(self) -> torch.Tensor:
        return compute_rope_cache(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self._rope_cache()

    def init_units(self) -> Iterator[tuple[str, Callable[[], None]]]:
        if self.tok_embeddings is not None:
            yield "tok_embeddings", lambda: nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        for name, block in self.layers.items():
            yield f"layers.{name}", block.init_weights
        if self.norm is not None:
            yield "norm", self.norm.reset_parameters
        if self.output is not None:
            yield "output", lambda: nn.init.normal_(self.output.weight, std=self.args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, *, return_hidden: bool = False):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (bs, seqlen, dim)
        rope = self.rope_cache if positions is None else self.rope_cache[positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        h = self.norm(h) if self.norm is not None else h
        if return_hidden:
            return h
        return self.output(h) if self.output is not None else h  # (bs, seqlen, vocab)


TINY_SPEC = ModelSpec("tiny_parallel", TinyParallelModel, {"tiny": TinyArgs()})
register_model_spec(TINY_SPEC)
