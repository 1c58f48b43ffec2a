"""Which linears LoRA can adapt, per family, and their PEFT names: read from the family's spec (``ModelSpec.adapters``:
its HF block map and where its plain-nn.Linear FFNs sit). MoE routed experts (grouped weights) and the router are
never adapted; DeepSeek-V3's attention is MLA (wq or wq_a/wq_b, wkv_a, wkv_b, wo: its HF map, one to one)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.sections.lora import DEFAULT_TARGETS
from torchtitan.spec import AdapterLayout, ModelSpec, get_model_spec, model_names

# Names a user may give for the MoE parts that are never adapted (besides a family's expert-only w1/w2/w3).
_EXPERT_WORDS = ("experts", "router", "gate", "expert_bias")


@dataclass(frozen=True)
class Target:
    name: str
    """Our short name (``wq``)."""
    paths: tuple[str, ...]
    """Where the module sits in a block (``attention.wq``; ``w1``: ``feed_forward.w1`` and, in an MoE family,
    ``feed_forward.shared_expert.w1``); a block holds one or none of them."""
    peft: str
    """The Hugging Face module name PEFT uses (``q_proj``)."""
    hf_path: str
    """Its path in an HF block (``self_attn.q_proj``)."""


def lora_families() -> list[str]:
    """The families whose spec says where LoRA adapts them."""
    return [name for name in model_names() if get_model_spec(name).adapters is not None]


def dense_families() -> list[str]:
    """The families QLoRA runs on (lora/quantize.py): the MoE families' LoRA is not quantized."""
    return [name for name in lora_families() if get_model_spec(name).adapters.dense]


def adapter_layout(spec: ModelSpec) -> AdapterLayout:
    if spec.adapters is None:
        raise NotImplementedError(
            f"lora.enable with model.name = {spec.name!r}: not built for this family (no LoRA targets or rows); LoRA "
            f"runs on {', '.join(lora_families())}: use one of those or turn lora.enable off"
        )
    return spec.adapters


def family_targets(spec: ModelSpec, blocks: list[nn.Module] = ()) -> dict[str, Target]:
    """Our short name -> Target, for every linear LoRA adapts in ``spec``'s family; a family read from its blocks
    (``AdapterLayout.linears``: ``hf``) has those of ``blocks``.

    Raises:
        NotImplementedError: the family is not one LoRA supports (one line naming those that are).
    """
    layout = adapter_layout(spec)
    if layout.linears is not None:
        return _read_targets(layout, blocks)
    out = {}
    for ours, hf in layout.block_names.items():
        path, hf_path = ours.removesuffix(".weight"), hf.removesuffix(".weight")
        parent, _, name = path.rpartition(".")
        if not ours.endswith(".weight") or "norm" in name or "conv" in name or name in out:
            continue  # per-head parameters (expert bias, Gated DeltaNet's A_log), norms, convolutions, repeats
        ffn = parent in ("feed_forward", "feed_forward.shared_expert") and name in ("w1", "w2", "w3")
        if parent != "attention" and not ffn:
            continue  # the router, the shared expert's gate (a router-like gate of one output)
        paths = (path,) if parent == "attention" else tuple(f"{p}.{name}" for p in layout.ffn_paths)
        if paths:
            out[name] = Target(name, paths, hf_path.rsplit(".", 1)[-1], hf_path)
    return out


def _read_targets(layout: AdapterLayout, blocks: list[nn.Module]) -> dict[str, Target]:
    """The targets of a family read from its blocks: one per module name (``q_proj``), at every path it has in any
    of ``blocks`` (a shared expert's ``gate_proj`` beside a dense layer's)."""
    paths: dict[str, list[str]] = {}
    for block in blocks:
        for path in layout.linears(block):
            found = paths.setdefault(path.rsplit(".", 1)[-1], [])
            if path not in found:
                found.append(path)
    return {name: Target(name, tuple(p), name, p[0]) for name, p in paths.items()}


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(FQN, block) of every repeated block ``model`` holds: a native family's ``layers`` (a ModuleDict), or the
    layers a model names itself (``decoder_layers``: transformers' own, ``hf.model.layers.N``)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return [(f"layers.{i}", block) for i, block in layers.items()]
    names = {id(m): name for name, m in model.named_modules()}
    return [(names[id(block)], block) for block in model.decoder_layers]


def resolve_targets(spec: ModelSpec, requested: list[str], blocks: list[nn.Module] = ()) -> list[Target]:
    """``lora.target_modules`` (ours or PEFT's names, mixed) -> the family's Targets, in block order. The default
    list (the seven linears of a dense block) means every linear the family adapts. ``blocks``: a family read
    from its blocks (``hf``) has the targets these hold.

    Raises:
        ConfigError: an unknown name, an MoE expert's or router's name (one line listing the valid ones), or an
            empty list.
    """
    targets = family_targets(spec, blocks)
    if list(requested) == DEFAULT_TARGETS:
        return list(targets.values())
    by_any = {**{t.peft: t for t in targets.values()}, **targets}
    unknown = [n for n in requested if n not in by_any]
    if unknown or not requested:
        valid = " ".join(t.name if t.name == t.peft else f"{t.name}/{t.peft}" for t in targets.values())
        what = f"has no linear named {', '.join(map(repr, unknown))}" if unknown else "is empty"
        experts = [n for n in unknown if _names_expert(spec, n)]
        if experts:
            what = (
                f"does not adapt {', '.join(map(repr, experts))}: MoE experts (grouped weights) and the router are "
                "not adapted (frozen base)"
            )
        raise ConfigError(
            f"lora.target_modules = {requested}: model.name = {spec.name!r} {what}; valid names (ours/PEFT's): {valid}"
        )
    wanted = {by_any[n].name for n in requested}
    return [t for t in targets.values() if t.name in wanted]


def _names_expert(spec: ModelSpec, name: str) -> bool:
    """``name`` is an MoE part this family has and does not adapt (routed experts, router, or an FFN linear name
    whose only nn.Linear home in this family would be the experts)."""
    layout = adapter_layout(spec)
    if layout.dense:
        return False
    ffn_names = {"w1", "w2", "w3", "gate_proj", "up_proj", "down_proj"}
    return any(w in name for w in _EXPERT_WORDS) or (name in ffn_names and not layout.ffn_paths)


def target_paths(block: nn.Module, targets: list[Target]) -> list[str]:
    """The paths in ``block`` of the targets it holds (an MoE layer has no dense ``feed_forward.w1``, a dense
    layer no shared expert)."""
    return [path for t in targets for path in t.paths if _holds(block, path)]


def _holds(block: nn.Module, path: str) -> bool:
    try:
        return isinstance(block.get_submodule(path), nn.Linear)
    except AttributeError:
        return False
