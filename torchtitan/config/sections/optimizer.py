"""The ``[optimizer]`` section of the config tree (torchtitan/config/schema.py holds the tree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import config_field as _f


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam", "Muon"] = _f(
        "AdamW",
        "optimizer; 'Muon' = Muon (the muon_* keys) for the hidden matrices (2-D weights inside layers, expert "
        "weights per expert) and AdamW (this section's settings) for embeddings, output, norms, biases, routers",
    )
    lr: float = _f(8e-4, "peak learning rate", bound=Bound(gt=0))
    eps: float = _f(1e-8, "Adam epsilon")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    weight_decay: float = _f(0.1, "decoupled weight decay (AdamW) or L2 penalty (Adam)")
    fused: bool = _f(
        False,
        "torch's fused Adam/AdamW kernel (CUDA and CPU; not bit-equal to foreach: ~1 ulp); default is the foreach "
        "implementation",
    )
    state_dtype: Literal["float32", "bfloat16"] | None = _f(
        None,
        "dtype of Adam's exp_avg / exp_avg_sq; bfloat16 halves the optimizer state (the update still runs in fp32); "
        "None = training.dtype",
    )
    bf16_stochastic_round: bool = _f(
        False,
        "with training.dtype = 'bfloat16': round each updated parameter to bf16 stochastically (unbiased: an update "
        "smaller than the weight's last bit still moves it on average) instead of to nearest; the random bits are a "
        "function of the step and the parameter (the same on every rank holding a copy, so replicas stay equal)",
    )
    no_decay: list[str] = _f(
        [],
        "parameters that get weight decay 0, by kind: any of 'norm', 'bias', 'embedding' (each family's canonical "
        "names; components/optim/param_groups.py), e.g. ['norm', 'bias', 'embedding']",
    )
    param_groups: list[dict[str, Any]] = _f(
        [],
        "ordered rules [[optimizer.param_groups]]: pattern (regex searched in the canonical parameter name; the "
        "first rule that matches wins), optionally optimizer (AdamW, Adam, Muon), lr, lr_multiplier, "
        "weight_decay, betas, eps (Adam/AdamW), momentum, nesterov, ns_steps, ns_coefficients, adjust_lr_fn "
        "(Muon); unset keys take this section's values; every parameter must match a rule (end with "
        "pattern = '.*'). On the CLI a TOML inline array: '[{pattern = \"norm\", weight_decay = 0.0}]'",
    )
    muon_lr: float | None = _f(None, "Muon's peak learning rate; None = optimizer.lr", bound=Bound(gt=0))
    muon_momentum: float = _f(0.95, "Muon's momentum", bound=Bound(ge=0))
    muon_nesterov: bool = _f(True, "Muon's Nesterov momentum")
    muon_ns_steps: int = _f(5, "Muon's Newton-Schulz iterations", bound=Bound(ge=1))
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = _f(
        "original",
        "Muon's shape-dependent lr scale (as torch.optim.Muon): original = sqrt(max(1, rows/cols)); "
        "match_rms_adamw = 0.2 * sqrt(max(rows, cols)) (Moonlight: reuse AdamW's lr and weight decay)",
    )
    early_step_in_backward: bool = _f(
        False,
        "step each parameter as soon as its gradient is final, during backward, and free that gradient (less "
        "memory: all gradients never live at once); needs training.max_norm = 0, gradient_accumulation_steps = 1, "
        "on_nonfinite = 'stop'; not with DDP or zero-bubble pipeline schedules (docs/compatibility.md)",
    )
