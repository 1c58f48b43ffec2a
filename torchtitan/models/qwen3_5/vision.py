"""Qwen3.5's vision tower: a ViT over 16x16 patches (2 frames deep) with learned positions resampled to each image's
grid and 2D rotary attention, then a merger of each 2x2 block of patches into one language-model token.

Images arrive as transformers' image processor gives them: ``pixel_values`` (patches, C * T * P * P), one row per
patch, the patches of each image in 2x2 merge-block order, and ``grid_thw`` (images, 3): each image's frames, patch
rows and patch columns. Every frame attends only to itself (``image_lengths``: an image is one frame, its
patches repeated over the two-frame depth). The submodule names are
transformers' (``patch_embed.proj``, ``blocks.N.attn.qkv``, ``merger.linear_fc1``...), so the HF weights map by
name. Pure torch: the attention is SDPA, one call per image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.init import trunc_normal_
from torchtitan.models.common.local import local_part


@dataclass(frozen=True)
class VisionArgs:
    """The tower's shape (transformers' ``vision_config``; the published models' defaults)."""

    depth: int = 27
    dim: int = 1152  # hidden_size
    ffn_dim: int = 4304  # intermediate_size
    n_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_dim: int = 3584  # out_hidden_size: the language model's width
    num_position_embeddings: int = 2304  # a 48 x 48 grid of learned positions
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_values(self) -> int:
        """Numbers per patch row of ``pixel_values``: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def merge_block_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of each patch of an h x w grid in merge-block order (the order of the processor's patches:
    block by block, each block's merge x merge patches row by row) -> two (h * w,) long tensors."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    return rows.reshape(blocks).transpose(1, 2).flatten(), cols.reshape(blocks).transpose(1, 2).flatten()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention within each image, with 2D rotary positions over the whole head."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, image_lengths: list[int]) -> torch.Tensor:
        """x (patches, dim); rope (patches, head_dim) [cos | sin] angles, each of head_dim / 2; image_lengths: each
        frame's patches."""
        return self.proj(per_image(*self.project(x, rope), image_lengths).flatten(1))

    def project(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v, each (patches, heads, head_dim)."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.n_heads, -1)).unbind(1)
        return _rotate(q, rope), _rotate(k, rope), v


def per_image(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image_lengths: list[int]) -> torch.Tensor:
    """Attention within each frame: one call a frame, on its rows (the calls follow the batch's images: a compiled
    tower compiles around this part, distributed/parallelize.py)."""
    outs = [
        F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
        for qi, ki, vi in zip(q.split(image_lengths), k.split(image_lengths), v.split(image_lengths))
    ]
    return torch.cat(outs)


def _rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x (patches, heads, head_dim) rotated as halves (x_i, x_{i + d/2}) by rope's angles, in fp32."""
    cos, sin = rope.float().chunk(2, dim=-1)  # (patches, head_dim / 2)
    cos, sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([sin, sin], dim=-1)[:, None]
    first, second = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-second, first], dim=-1) * sin).type_as(x)


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.dim, args.ffn_dim)
        self.linear_fc2 = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm (LayerNorm) attention within each image, then the GELU MLP, residual each."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(args.dim, eps=1e-6)
        self.attn = VisionAttention(args)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, image_lengths: list[int]) -> torch.Tensor:
        # attention's inputs and everything after the per-frame attention are tensor-only steps (training.compile
        # compiles them: they take no frame lengths); the per-frame attention between them
        return self.finish(x, per_image(*self.attend_inputs(x, rope), image_lengths))

    def attend_inputs(self, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attn.project(self.norm1(x), rope)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.attn.proj(attended.flatten(1))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Each patch row (C x T x P x P numbers) through a 3D convolution of its own size: a linear map to ``dim``."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.kernel = (args.in_channels, args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.dim, self.kernel[1:], stride=self.kernel[1:])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(patches, patch_values) -> (patches, dim)."""
        return self.proj(pixel_values.view(-1, *self.kernel).to(self.proj.weight.dtype)).flatten(1)


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's patches side by side through a GELU MLP to the LM's width."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        merged = args.dim * args.spatial_merge_size**2
        self.norm = nn.LayerNorm(args.dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, args.out_dim)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (patches, dim), merge blocks contiguous -> (patches / merge^2, out_dim)."""
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


class VisionTower(nn.Module):
    """Patches -> the language model's image tokens (one per merge block)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.dim)
        self.blocks = nn.ModuleList([VisionBlock(args) for _ in range(args.depth)])
        self.merger = PatchMerger(args)
        quarter = args.head_dim // 2  # each axis rotates half the head with head_dim / 4 frequencies
        self.register_buffer(
            "inv_freq", 1.0 / args.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter), False
        )

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv3d)):
                trunc_normal_(module.weight, mean=0.0, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        nn.init.normal_(self.pos_embed.weight, std=0.02)
        quarter = self.args.head_dim // 2
        with torch.no_grad():
            self.inv_freq.copy_(
                1.0 / self.args.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)
            )

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values (patches, patch_values); grid_thw: each image's (frames, rows, columns) of patches, read on
        the host (the processor's) -> (patches / merge^2, out_dim)."""
        patches = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape[0] != patches:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[0]} patch rows and grid_thw {list(grid_thw)} needs {patches}; "
                "pass the image processor's pixel_values with its image_grid_thw"
            )
        x = self.patch_embed(pixel_values)  # (patches, dim)
        positions, rope = self._positions(grid_thw, x.device)
        x = x + positions.to(x.dtype)
        lengths = [h * w for t, h, w in grid_thw for _ in range(t)]  # each frame attends to itself (transformers')
        for block in self.blocks:
            x = block(x, rope, lengths)
        return self.merger(x)

    def _positions(self, grid_thw, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(learned positions (patches, dim), rope angles (patches, head_dim) [cos | sin]) in the patches' order."""
        side, merge = math.isqrt(self.args.num_position_embeddings), self.args.spatial_merge_size
        # local_part: under tensor parallel the table is a Replicate DTensor (distributed/tensor_parallel/vision.py)
        table = local_part(self.pos_embed.weight).t().reshape(1, -1, side, side)  # (1, dim, side, side)
        learned, angles = [], []
        for t, h, w in grid_thw:
            rows, cols = merge_block_order(h, w, merge, device)
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]  # (dim, h, w)
            learned.append(grid[:, rows, cols].t().repeat(t, 1))
            axes = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=-1)  # (h w, hd / 2)
            angles.append(axes.repeat(t, 1))
        angles = torch.cat(angles)
        return torch.cat(learned), torch.cat([angles.cos(), angles.sin()], dim=-1)


__all__ = ["VisionArgs", "VisionTower", "merge_block_order"]
