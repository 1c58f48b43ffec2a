"""RoPE on CPU: the shipped complex-multiply form against the real-arithmetic form it replaced, side by side.

The real form (four products, a difference, a sum and a stack per call, seven kernels forward and seven
backward) was 5-7% of a debug-model training step on CPU, most of the gap to torchtitan-2024's trainer
(docs/performance.md). Both forms are checked bit-equal (forward and the input gradient) before timing; then
``--reps`` rounds of ``--iters`` forward+backward calls each, taking turns. Prints one JSON object.

    python -m bench.rope [--bs 8] [--seq_len 256] [--heads 16] [--head_dim 16] [--iters 100] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchtitan.models.llama.model import apply_rotary_emb, compute_rope_cache
from torchtitan.observability.peak_cache import cpu_model_name


def real_form(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """The earlier apply_rotary_emb: the rotation of each pair in real arithmetic."""
    cos, sin = rope.unsqueeze(-2).chunk(2, dim=-1)
    x_even, x_odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([x_even * cos - x_odd * sin, x_even * sin + x_odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def _fwd_bwd(fn, x: torch.Tensor, rope: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    out = fn(x, rope)
    out.backward(grad)
    return out.detach(), x.grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head_dim", type=int, default=16)  # the debug model's (dim 256, 16 heads)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.bs, args.seq_len, args.heads, args.head_dim, generator=g)
    grad = torch.randn(x.shape, generator=g)
    rope = compute_rope_cache(args.head_dim, args.seq_len, 500000.0)
    forms = {"real": real_form, "complex": apply_rotary_emb}
    results = {name: _fwd_bwd(fn, x, rope, grad) for name, fn in forms.items()}
    exact = all(torch.equal(a, b) for a, b in zip(results["real"], results["complex"]))
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.reps):
        for name, fn in forms.items():
            start = time.perf_counter()
            for _ in range(args.iters):
                _fwd_bwd(fn, x, rope, grad)
            times[name].append((time.perf_counter() - start) / args.iters)
    real, cplx = statistics.median(times["real"]), statistics.median(times["complex"])
    print(
        json.dumps(
            {
                "cpu": cpu_model_name(),
                "shape": list(x.shape),
                "threads": torch.get_num_threads(),
                "bit_equal_forward_and_grad": exact,
                "real_ms": round(real * 1e3, 3),
                "complex_ms": round(cplx * 1e3, 3),
                "speedup": round(real / cplx, 2),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
