"""LoRA in the parallelism planner's lower bound (``PlanTerms``, components/seams.py): only the adapters have
gradients and optimizer state (the run's AdamW: 2 moments each), the frozen base its parameters alone, and under
QLoRA the adapted linears' weights at NF4's bytes; and its line in the start summary (rank, targets, trainable
share)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan.components.seams import PlanTerms
from torchtitan.features.lora.checks import adapted_shapes, target_names, target_shapes
from torchtitan.features.lora.quantize import nf4_bytes

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig


def adapter_param_count(config: JobConfig, n_layers: int) -> int:
    """LoRA's trainable parameters: rank x (in + out) per adapted linear of every block (dense or MoE: its own)."""
    return sum(config.lora.rank * (out + inp) for out, inp in adapted_shapes(config, n_layers))


class LoraPlanTerms(PlanTerms):
    """The planner's terms of a run with ``lora.enable`` (features/registry.py)."""

    def trainable(self, config: JobConfig, args: Any, params: int) -> int:
        return adapter_param_count(config, args.n_layers)

    def summary(self, config: JobConfig, args: Any, params: int) -> str:
        """'LoRA rank 8 on wq,wk,wv,wo: 0.42% of parameters trainable (2,048 of 487,424)' (QLoRA: 'QLoRA (NF4
        base) rank 8 ...'); ``params``: the base's, the adapters come on top."""
        lora, adapters = config.lora, self.trainable(config, args, params)
        name = "QLoRA (NF4 base)" if lora.quantize_base == "nf4" else "LoRA"
        total = params + adapters
        return (
            f"{name} rank {lora.rank} on {','.join(target_names(config))}: {adapters / total:.2%} of parameters "
            f"trainable ({adapters:,} of {total:,})"
        )

    def param_bytes(self, config: JobConfig, args: Any, params: int) -> int:
        """4 bytes each (fp32), but NF4's for the adapted linears' weights under QLoRA."""
        if config.lora.quantize_base != "nf4":
            return params * 4
        sizes = [out * inp for out, inp in target_shapes(config).values()] * args.n_layers
        return (params - sum(sizes)) * 4 + sum(nf4_bytes(n) for n in sizes)

    def state_bytes(self, config: JobConfig, args: Any, trainable: int) -> int | None:
        return trainable * 4 * (1 if config.optimizer.state_dtype == "bfloat16" else 2)


def plan_terms(config: JobConfig) -> LoraPlanTerms:
    return LoraPlanTerms()
