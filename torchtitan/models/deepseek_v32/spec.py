"""DeepSeek-V3.2 ("deepseek_v32") wired to the trainer: its ModelSpec, its pre-launch check, the indexer loss's
step hook and HF refusal.

It reuses DeepSeek-V3's wiring (the MoE check, load balancer, active-parameter count). Not part of the pure model:
this module may import ``torchtitan.spec`` and the config's errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.mesh import StepMeans
from torchtitan.models.deepseek_v3.spec import check_deepseek_v3_config, with_mtp
from torchtitan.models.deepseek_v32 import DeepSeekV32Transformer, deepseek_v32_configs
from torchtitan.models.deepseek_v32.hf_adapter import ADAPTER
from torchtitan.models.moe.spec import BUILD_LOAD_BALANCER, MOE_WIRING
from torchtitan.spec import AdapterLayout, ModelSpec, StepHooks, chain_hooks

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Experimental, Model, Training
    from torchtitan.distributed.mesh import OuterSum, WorldMesh
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_deepseek_v32_config(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """What DSA cannot run under (CP, TP, PP), an index_topk the sequence cannot make sparse, then DeepSeek-V3's
    check.

    Raises ConfigError for an ``index_topk`` not below ``training.seq_len`` in the sparse stage (its attention would
    be dense: the stage would not be what it says).

    Returns:
        DeepSeek-V3's warnings.
    """
    named = f"model.name = {model.name!r} (flavor {model.flavor!r})"
    exp = experimental
    refused = [
        (
            exp.context_parallel_degree > 1,
            f"experimental.context_parallel_degree = {exp.context_parallel_degree} with {named}: DSA's top-k runs "
            "over the indexer's scores of the whole sequence, which the CP ring never holds on one rank; set "
            "context_parallel_degree = 1",
        ),
        (
            training.tensor_parallel_degree > 1,
            f"training.tensor_parallel_degree = {training.tensor_parallel_degree} with {named}: the indexer's heads "
            "have no TP plan (they are summed into one score per key before the top-k); set "
            "tensor_parallel_degree = 1 and use FSDP / expert parallel",
        ),
        (
            exp.pipeline_parallel_degree > 1,
            f"experimental.pipeline_parallel_degree = {exp.pipeline_parallel_degree} with {named}: every layer's "
            "indexer loss is added to the loss, which the middle stages cannot do; set pipeline_parallel_degree = 1",
        ),
    ]
    for bad, message in refused:
        if bad:
            raise NotImplementedError(message)
    if args.dsa_stage == "sparse" and args.index_topk >= training.seq_len:
        smaller = [
            f"{name} ({a.index_topk})" for name, a in deepseek_v32_configs.items() if a.index_topk < training.seq_len
        ]
        raise ConfigError(
            f"{named}: index_topk = {args.index_topk} >= training.seq_len = {training.seq_len}: every query would keep "
            "every causal key, so the sparse stage would train dense attention; allowed: index_topk < seq_len; set "
            f"training.seq_len > {args.index_topk}, model.dsa_stage = 'dense_warmup', or a flavor with a smaller "
            f"index_topk ({', '.join(smaller) or 'none listed'})"
        )
    return check_deepseek_v3_config(args, model=model, training=training, experimental=experimental)


def configure_dsa_stage(flavor: Any, model: Model) -> Any:
    """The flavor's args under ``model.dsa_stage`` (its own stage where "flavor") with the run's multi-token-prediction
    depths (``model.mtp_layers``, as DeepSeek-V3's)."""
    args = with_mtp(flavor, model)
    return args if model.dsa_stage == "flavor" else dataclasses.replace(args, dsa_stage=model.dsa_stage)


def check_dsa_stage_key(config: JobConfig, dims: ParallelDims) -> list[str]:
    """``model.dsa_stage`` set: only this family has DSA's stages (the registry's "dsa_stage" row)."""
    if config.model.dsa_stage != "flavor" and config.model.name != "deepseek_v32":
        raise ConfigError(
            f"model.dsa_stage = {config.model.dsa_stage!r} with model.name = {config.model.name!r}: the family has no "
            "sparse attention stages; use model.name = 'deepseek_v32' or drop the key"
        )
    return []


class IndexerLoss:
    """``StepHooks`` adding the model's indexer loss (DSA) to each micro-batch's loss at its scale, and logging it:
    ``indexer_loss`` in the step record (TensorBoard "loss_metrics/indexer_loss"), the term as added to the loss
    (``indexer_loss_coeff`` times the layers' summed KL) averaged over the step's micro-batches and data-parallel
    ranks."""

    def __init__(self, world: WorldMesh, device: torch.device):
        self.means = StepMeans(1, world, device)

    def aux_loss(self, model_part: nn.Module, scale: float) -> torch.Tensor:
        loss = model_part.indexer_loss()  # () the last training forward's term
        self.means.add(0, loss, 1.0)
        return loss * scale

    @torch.no_grad()
    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        self.means.reduce(keep_metrics)

    def after_optimizer_step(self) -> None:
        pass

    def discard_step(self) -> None:
        self.means.take()

    def metrics(self) -> tuple[dict[str, float], dict[str, float]] | None:
        last = self.means.take()
        if last is None:
            return None
        return {"indexer_loss": last[0]}, {"loss_metrics/indexer_loss": last[0]}


def build_dsa_step_hooks(
    args: Any, whole: nn.Module, parts: list[nn.Module], world: WorldMesh, device: torch.device, **kwargs: Any
) -> StepHooks | None:
    """MoE's load balancer, then the indexer loss."""
    return chain_hooks(BUILD_LOAD_BALANCER(args, whole, parts, world, device, **kwargs), IndexerLoss(world, device))


def deepseek_v32_hf_refusal(args: Mapping[str, Any]) -> str | None:
    """Weights whose layers ``DeepseekV32ForCausalLM`` does not compute (None where they export exactly)."""
    why = []
    if args.get("moe_every", 1) != 1:
        why.append(f"moe_every = {args['moe_every']} (DeepseekV32 has every layer from first_k_dense_replace MoE)")
    if args.get("norm_type", "rmsnorm") not in ("rmsnorm", "fused_rmsnorm"):
        why.append(f"model.norm_type = {args['norm_type']!r} (DeepseekV32 uses RMSNorm)")
    if not why:
        return None
    return (
        f"deepseek_v32 weights with {'; '.join(why)} have no Hugging Face DeepseekV32ForCausalLM counterpart; "
        f"train a listed flavor ({', '.join(deepseek_v32_configs)}) with model.norm_type = 'rmsnorm'"
    )


SPEC = ModelSpec(
    "deepseek_v32",
    DeepSeekV32Transformer,
    deepseek_v32_configs,
    **{**MOE_WIRING, "check_fn": check_deepseek_v32_config, "build_step_hooks": build_dsa_step_hooks},
    state_dict_adapter=ADAPTER,
    adapters=AdapterLayout(ADAPTER.block_names, ("feed_forward", "feed_forward.shared_expert"), peft_ffn_remapped=True),
    hf_model_type="deepseek_v32",
    hf_refusal=deepseek_v32_hf_refusal,
    pipeline_split_fn=None,
    configure=configure_dsa_stage,
)
