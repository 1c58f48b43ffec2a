"""The LoRA model transform: target linears become ``LoRALinear``, everything else is frozen.

Applied to a meta model (or pipeline stage) before the parallelisms, like float8's conversion (the registry's
``model_transform`` slot):
TP then shards each adapter to match its base linear (lora/tensor_parallel.py), FSDP shards adapters and
frozen base alike (the frozen weights get no gradient, so no reduce-scatter). The model's code is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchtitan.components.seams import ModelTransform
from torchtitan.config.sections.lora import Lora
from torchtitan.distributed.init import init_named_units
from torchtitan.features.lora.linear import LoRALinear, is_adapter_key
from torchtitan.features.lora.names import Target, model_blocks, resolve_targets, target_paths
from torchtitan.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from torchtitan.config.manager import JobConfig


def apply_lora(model: nn.Module, lora: Lora, spec: ModelSpec) -> list[str]:
    """Swap ``lora.target_modules`` of every block ``model`` holds for LoRALinears and freeze the rest (in place).

    Returns:
        the FQNs of the adapted linears.
    """
    blocks = model_blocks(model)
    targets = resolve_targets(spec, lora.target_modules, [block for _, block in blocks])
    adapted = []
    for prefix, block in blocks:
        for path in target_paths(block, targets):
            parent_path, _, leaf = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            base = getattr(parent, leaf)
            assert type(base) is nn.Linear, f"{prefix}.{path} is {type(base).__name__}"
            # Plain meta tensors like the rest of the meta model, also where the memory estimator builds under a
            # FakeTensorMode (a fake parameter made here could not be materialised by to_empty).
            with unset_fake_temporarily():
                new = LoRALinear.from_linear(base, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
            setattr(parent, leaf, new)
            adapted.append(f"{prefix}.{path}")
    freeze_base(model)
    return adapted


def freeze_base(model: nn.Module) -> None:
    """Every parameter but the adapters' stops requiring gradients (the parallelisms keep it so: TP re-freezes what
    torch's SequenceParallel re-creates, distributed/tensor_parallel/plan.py)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(FQN, module) of every LoRALinear in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def init_lora_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's default init of every adapter (A Kaiming-uniform, B zero), a function of the seed and the FQN only,
    so every layout (sharded A/B included) and every pipeline stage draws the single-process values."""
    units: list[tuple[str, Callable[[], None]]] = [
        (f"lora.{_plain(n)}", m.init_adapter) for n, m in lora_modules(model)
    ]
    init_named_units(units, seed)


class LoraTransform(ModelTransform):
    """Adapters on the frozen base before TP (so each adapter is sharded like its linear), drawn from the seed after
    the base's init."""

    def __init__(self, lora: Lora, spec: ModelSpec):
        self.lora, self.spec = lora, spec

    def convert(self, part: nn.Module) -> None:
        apply_lora(part, self.lora, self.spec)

    def after_init(self, part: nn.Module, seed: int) -> None:
        init_lora_adapters(part, seed)


def build_lora_transform(config: JobConfig, spec: ModelSpec, device: torch.device) -> LoraTransform:
    return LoraTransform(config.lora, spec)


# Module-name parts that wrappers insert (activation checkpointing, torch.compile): not part of a layer's name.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _plain(fqn: str) -> str:
    """The FQN without wrapper parts, so the adapters' init does not depend on AC or compile."""
    for part in _WRAPPERS:
        fqn = fqn.replace(part, "")
    return fqn


__all__ = [
    "Target",
    "apply_lora",
    "freeze_base",
    "init_lora_adapters",
    "is_adapter_key",
    "lora_modules",
    "target_paths",
]
