"""Adam / AdamW whose moment estimates are stored in bfloat16 (half the optimizer-state memory).

The update runs in fp32: each parameter's exp_avg / exp_avg_sq are upcast, updated with exactly
the arithmetic of ``torch.optim.AdamW`` (single-tensor path), and written back rounded to nearest.
Parameters are visited one at a time, so the fp32 working copies cost one parameter's worth of
memory, never a second copy of the whole state (a foreach over all parameters would).

Rounding: round-to-nearest, not stochastic rounding. bf16 keeps 8 significant bits, so an update
smaller than 2^-9 of the stored value is lost; exp_avg_sq with beta2 = 0.95 moves by 5 % per step,
far above that. Measured over 50 steps of the tiny llama (8 x 64 tokens, lr 3e-3, wd 0.1), max
relative loss deviation from fp32 states: beta2 0.95: nearest 5.3e-4, stochastic 1.7e-4; beta2
0.999: nearest 2.5e-4, stochastic 3.5e-4. No consistent gain, and stochastic rounding costs a random draw per
element and makes the update depend on the RNG stream (and on how FSDP shards it), so it is not used.

Parameters stored in bf16 (training.dtype = "bfloat16", no fp32 master copy) take the same fp32 update and are
written back rounded to nearest, or stochastically (``stochastic_round``): the fp32 result's 16 dropped bits
decide, with probability equal to their fraction, whether it rounds up, so the expected stored weight equals the
fp32 one and updates below the weight's last bit are not all lost. The random bits come from a generator seeded
by the step and the parameter's index: the same on every rank that holds a copy of it (TP replicas, DDP), no
state to checkpoint, the same after a resume.

Works on plain tensors and DTensors (FSDP2 Shard(0), TP, FSDP x TP): the state is created with the
parameter's placements, and the elementwise update runs on the local shards. The state keys are
torch's ("step", "exp_avg", "exp_avg_sq"), so state_dict / load_state_dict and DCP's
get_optimizer_state_dict / set_optimizer_state_dict handle it like torch.optim.AdamW.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from torchtitan.distributed.backend.dtensor import in_layout_of, local_shard
from torchtitan.dtypes import to_dtype

_STATE_DTYPES = ("float32", "bfloat16")


class LowPrecisionAdamW(torch.optim.Optimizer):
    """Adam (L2 penalty) or AdamW (decoupled weight decay) with moments stored in ``state_dtype``.

    Args:
        decoupled_weight_decay: True = AdamW (shrink the parameter by lr * weight_decay), False = Adam
            (add weight_decay * param to the gradient), as torch.optim.Adam's flag of the same name.
        state_dtype: "bfloat16" (half the state memory) or "float32" (bit-identical to torch's AdamW
            with foreach=False; kept as the reference the bf16 mode is tested against).
        stochastic_round: bf16 parameters are written back rounded stochastically (module docstring).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        decoupled_weight_decay: bool = True,
        state_dtype: str = "bfloat16",
        stochastic_round: bool = False,
    ):
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"state_dtype = {state_dtype!r}: allowed are {list(_STATE_DTYPES)}")
        self.state_dtype = to_dtype(state_dtype)
        self.stochastic_round = stochastic_round
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled_weight_decay
        )
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            # zeros_like keeps a DTensor's mesh and placements, so DCP saves the state sharded.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LowPrecisionAdamW does not support sparse gradients")
                self._update(p, self._init_state(p), group, index)
        return loss

    def _update(self, p: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any], index: int) -> None:
        param, grad = local_shard(p), local_shard(in_layout_of(p, p.grad))  # the local update needs p's layout
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"].item()
        # fp32 working copies (copies even in fp32 mode, so the code path is the same in both).
        exp_avg = local_shard(state["exp_avg"]).float()
        exp_avg_sq = local_shard(state["exp_avg_sq"]).float()
        grad32 = grad.float()
        param32 = param.float() if param.dtype != torch.float32 else param
        if wd != 0:
            if group["decoupled_weight_decay"]:
                param32.mul_(1 - lr * wd)
            else:
                grad32 = grad32.add(param32, alpha=wd)
        # The arithmetic of torch.optim.adam._single_tensor_adam, op for op.
        exp_avg.lerp_(grad32, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad32, grad32, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param32.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if param32 is not param and self.stochastic_round and param.dtype == torch.bfloat16:
            generator = torch.Generator(param.device).manual_seed(int(step) * 1_000_003 + index)
            stochastic_round_(param, param32, generator)
        elif param32 is not param:
            param.copy_(param32)  # to nearest
        local_shard(state["exp_avg"]).copy_(exp_avg)  # rounds to nearest in bf16 mode
        local_shard(state["exp_avg_sq"]).copy_(exp_avg_sq)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load casts every state tensor to the parameter's dtype; cast the moments back."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (local shards)."""
        tensors = (t for s in self.state.values() for t in s.values() if isinstance(t, torch.Tensor))
        return sum(local_shard(t).nbytes for t in tensors)


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``dst`` (bf16) = fp32 ``src`` rounded stochastically: up with probability (dropped low 16 bits) / 2^16.

    Adds a uniform 16-bit integer to the fp32 bit pattern and clears the low 16 bits, which bf16 drops: exact in
    bf16, unbiased (E[dst] = src), in magnitude for negative values as for positive ones; inf stays inf.
    """
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    bits = src.contiguous().view(torch.int32).add(noise).bitwise_and_(-(1 << 16))  # -(1 << 16) = 0xFFFF0000
    return dst.copy_(bits.view(torch.float32))
