"""The ``[lora]`` section of the config tree (torchtitan/config/schema.py holds the tree; docs/lora.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE
from torchtitan.config.fields import config_field as _f

# Every linear of a dense block (PEFT's "all-linear" less the output head), in our names.
DEFAULT_TARGETS = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


@dataclass
class Lora:
    enable: bool = _f(
        False,
        "fine-tune low-rank adapters on a frozen base (LoRA): only the adapters get gradients and optimizer "
        "(the run's [optimizer], AdamW by default) state, checkpoints hold the adapters only; docs/lora.md",
    )
    rank: int = _f(8, "adapter rank r: A is (r, in), B is (out, r); at most the smallest target dim", bound=POSITIVE)
    alpha: float = _f(
        16.0, "scaling numerator: the update is (alpha / rank) * B A x (PEFT's lora_alpha)", bound=Bound(gt=0)
    )
    dropout: float = _f(0.0, "dropout on the adapter's input (PEFT's lora_dropout); 0 = none", bound=Bound(ge=0))
    target_modules: list[str] = _f(
        DEFAULT_TARGETS,
        "linears that get adapters, in every block: our names (wq wk wv wo w1 w2 w3) or PEFT's (q_proj k_proj "
        "v_proj o_proj gate_proj up_proj down_proj), mapped through the family's Hugging Face adapter; the default "
        "means every linear the family adapts (MoE families: attention, dense FFNs, shared experts; never the routed "
        "experts or the router: docs/lora.md)",
    )
    adapter_path: str = _f(
        "",
        "a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) to start the adapters from instead of "
        "their init (a fresh start; a resume takes the checkpoint's); its r, lora_alpha and targets must match",
    )
    quantize_base: Literal["none", "nf4"] = _f(
        "none",
        "QLoRA: 'nf4' stores the frozen base weights of the adapted linears as 4-bit NormalFloat (torchao's "
        "NF4Tensor: 0.52 byte/element), dequantized per layer in forward; needs torchao ('torchtitan[lora]'); "
        "one process or FSDP2 only; 'none' keeps the base in the run's dtype; docs/lora.md",
    )
