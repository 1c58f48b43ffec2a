"""Pre-launch checks of ``[lora]``: the family, the target names, the rank, and what LoRA does not combine with."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from torchtitan.config.errors import ConfigError
from torchtitan.lora.names import resolve_targets
from torchtitan.lora.quantize import check_nf4_shapes, check_torchao_for_nf4
from torchtitan.spec import flavor_args, get_model_spec

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims


def check_lora(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Raises ConfigError (bad values) or NotImplementedError (combinations not built), one line each."""
    lora = config.lora
    if not lora.enable:
        if lora.quantize_base != "none":
            raise ConfigError(
                f"lora.quantize_base = {lora.quantize_base!r} without lora.enable: QLoRA quantizes the frozen base "
                "under adapters; set lora.enable = true or lora.quantize_base = 'none'"
            )
        return []
    spec = get_model_spec(config.model.name)
    targets = resolve_targets(spec, lora.target_modules)  # the family and the names
    smallest = min(min(shape) for shape in target_shapes(config).values() if shape)
    if lora.rank > smallest:
        raise ConfigError(
            f"lora.rank = {lora.rank} is larger than the smallest dim ({smallest}) of the targets "
            f"{[t.name for t in targets]} of model {config.model.flavor}; use a rank <= {smallest}"
        )
    if not lora.dropout < 1:
        raise ConfigError(f"lora.dropout = {lora.dropout}: must be in [0, 1); 0 turns it off")
    _check_combinations(config, dims)
    if lora.quantize_base != "none":
        check_qlora_layout(config, dims)
        check_nf4_shapes(target_shapes(config), dims.dp_shard if dims.fsdp_enabled else 1)
    return []


def check_qlora_layout(config: JobConfig, dims: ParallelDims) -> None:
    """QLoRA runs in one process or under FSDP2 over one mesh axis (docs/lora.md); the rest is refused."""
    refusals = [
        (dims.tp_enabled, "training.tensor_parallel_degree > 1", "TP would shard NF4 blocks across ranks"),
        (dims.pp_enabled, "experimental.pipeline_parallel_degree > 1", "no QLoRA pipeline row is tested"),
        (dims.cp > 1, "experimental.context_parallel_degree > 1", "no QLoRA context-parallel row is tested"),
        (dims.dp_replicate_enabled, "training.data_parallel_replicate_degree > 1", "DDP/HSDP would replicate it"),
        (config.training.enable_cpu_offload, "training.enable_cpu_offload", "offload of NF4 shards is not built"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise NotImplementedError(
                f"lora.quantize_base = {config.lora.quantize_base!r} with {key}: not built ({why}); QLoRA runs in "
                "one process or under FSDP2 (training.data_parallel_shard_degree) only: drop that key or set "
                "lora.quantize_base = 'none'"
            )


def check_qlora_torchao(config: JobConfig, dims: ParallelDims) -> list[str]:
    """This machine: ``lora.quantize_base = 'nf4'`` needs torchao."""
    if config.lora.enable:
        check_torchao_for_nf4(config.lora.quantize_base)
    return []


def target_shapes(config: JobConfig) -> dict[str, tuple[int, int]]:
    """Our target name -> (out, in) of that linear in a block of the configured flavor (a meta build of one block)."""
    spec = get_model_spec(config.model.name)
    args = dataclasses.replace(flavor_args(config.model), n_layers=1)
    with torch.device("meta"):
        block = spec.model_cls(args).layers["0"]
    out = {}
    for t in resolve_targets(spec, config.lora.target_modules):
        w = block.get_submodule(t.path).weight
        out[t.name] = tuple(w.shape)
    return out


def _check_combinations(config: JobConfig, dims: ParallelDims) -> None:
    refusals = [
        (config.float8.enable_float8_linear, "float8.enable_float8_linear (a float8 base under LoRA)"),
        (
            dims.tp_enabled and config.experimental.enable_async_tensor_parallel,
            "experimental.enable_async_tensor_parallel",
        ),
        (config.optimizer.early_step_in_backward, "optimizer.early_step_in_backward"),
        (config.fault_tolerance.enable, "fault_tolerance.enable"),
        (config.training.compile, "training.compile (untested with the adapters)"),
        (dims.tp_enabled and config.lora.dropout > 0, "lora.dropout > 0 under tensor parallel"),
        # adapters get the run's AdamW; rules over the frozen base's names (norms, embeddings) would match nothing
        (
            config.optimizer.name == "Muon" or bool(config.optimizer.param_groups) or bool(config.optimizer.no_decay),
            "optimizer.name = 'Muon', optimizer.param_groups or optimizer.no_decay (the adapters train with AdamW)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise NotImplementedError(
                f"lora.enable with {what}: not built; turn that off (docs/lora.md lists what LoRA runs with)"
            )
