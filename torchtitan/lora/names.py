"""Which linears LoRA can adapt, per family, and their PEFT names (read from the family's HF name map)."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.config.errors import ConfigError
from torchtitan.spec import ModelSpec

# The families whose every block is dense (attention + one FFN): their linears are the targets. The MoE
# families' experts are grouped weights (no nn.Linear per expert) and are not adapted.
LORA_FAMILIES = ("llama3", "qwen3")


@dataclass(frozen=True)
class Target:
    name: str
    """Our short name (``wq``)."""
    path: str
    """The module's path in a block (``attention.wq``)."""
    peft: str
    """The Hugging Face module name PEFT uses (``q_proj``)."""
    hf_path: str
    """Its path in an HF block (``self_attn.q_proj``)."""


def family_targets(spec: ModelSpec) -> dict[str, Target]:
    """Our short name -> Target, for every linear of a block of ``spec``'s family.

    Raises:
        NotImplementedError: the family is not one LoRA supports (one line naming those that are).
    """
    if spec.name not in LORA_FAMILIES:
        raise NotImplementedError(
            f"lora.enable with model.name = {spec.name!r}: LoRA is built for the dense families "
            f"{', '.join(LORA_FAMILIES)} (MoE experts are grouped weights, not adapted: llama3_moe, qwen3_moe, "
            "deepseek_v3, gpt_oss); use one of those families or turn lora.enable off"
        )
    out = {}
    for ours, hf in spec.state_dict_adapter.BLOCK_NAMES.items():
        path, hf_path = ours.removesuffix(".weight"), hf.removesuffix(".weight")
        if "norm" in path:
            continue
        name = path.rsplit(".", 1)[-1]
        out[name] = Target(name, path, hf_path.rsplit(".", 1)[-1], hf_path)
    return out


def resolve_targets(spec: ModelSpec, requested: list[str]) -> list[Target]:
    """``lora.target_modules`` (ours or PEFT's names, mixed) -> the family's Targets, in block order.

    Raises:
        ConfigError: an unknown name (one line listing the valid ones) or an empty list.
    """
    targets = family_targets(spec)
    by_any = {**{t.peft: t for t in targets.values()}, **targets}
    unknown = [n for n in requested if n not in by_any]
    if unknown or not requested:
        valid = " ".join(f"{t.name}/{t.peft}" for t in targets.values())
        what = f"has no linear named {', '.join(map(repr, unknown))}" if unknown else "is empty"
        raise ConfigError(
            f"lora.target_modules = {requested}: model.name = {spec.name!r} {what}; valid names (ours/PEFT's): {valid}"
        )
    wanted = {by_any[n].name for n in requested}
    return [t for t in targets.values() if t.name in wanted]
