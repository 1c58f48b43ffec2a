"""Pre-launch checks of ``[lora]``: the family, the target names, the rank, and what LoRA does not combine with."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.features.lora.names import (
    adapter_layout,
    dense_families,
    family_targets,
    model_blocks,
    resolve_targets,
    target_paths,
)
from torchtitan.features.lora.peft_io import check_peft_exportable
from torchtitan.features.lora.quantize import check_nf4_shapes, check_torchao_for_nf4
from torchtitan.spec import flavor_args, get_model_spec, hf_conversion_refusal

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
    adapter_layout(spec)  # the family (one line naming those LoRA runs on)
    blocks, kinds = _meta_layers(config)
    targets = resolve_targets(spec, lora.target_modules, blocks)  # the family and the names
    by_kind = _kind_shapes(spec, lora.target_modules, blocks, kinds)
    shapes = [s for kind in by_kind.values() for s in kind.values()]
    if not shapes:
        raise ConfigError(
            f"lora.target_modules = {lora.target_modules}: model {config.model.name} flavor {config.model.flavor} has "
            f"none of them (deepseek_v3's wq_a/wq_b exist only with q_lora_rank > 0, its wq only without); name "
            f"linears it has: {' '.join(family_targets(spec, blocks))}"
        )
    smallest = min(min(s) for s in shapes)
    if lora.rank > smallest:
        raise ConfigError(
            f"lora.rank = {lora.rank} is larger than the smallest dim ({smallest}) of the targets "
            f"{[t.name for t in targets]} of model {config.model.flavor}; use a rank <= {smallest}"
        )
    if not lora.dropout < 1:
        raise ConfigError(f"lora.dropout = {lora.dropout}: must be in [0, 1); 0 turns it off")
    _check_combinations(config, dims)
    if not spec.adapters.dense and spec.adapters.linears is None:  # a family read from its blocks: its own checks
        _check_moe_layout(config, dims)
    if config.checkpoint.last_save_in_hf:
        check_peft_exportable(spec, lora.target_modules)
    if lora.adapter_path and spec.state_dict_adapter is None:  # a PEFT folder is in HF names (llama3_moe has none)
        raise NotImplementedError(f"lora.adapter_path = {lora.adapter_path!r}: {hf_conversion_refusal(spec, {})}")
    if lora.quantize_base != "none":
        if not spec.adapters.dense:
            raise NotImplementedError(
                f"lora.quantize_base = {lora.quantize_base!r} with model.name = {spec.name!r}: not built (QLoRA runs on "
                f"the dense families {', '.join(dense_families())}); set lora.quantize_base = 'none' for LoRA on it"
            )
        check_qlora_layout(config, dims)
        check_nf4_shapes(_first_kind(by_kind), dims.dp_shard if dims.fsdp_enabled else 1)
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


def target_names(config: JobConfig) -> list[str]:
    """The names of the linears ``lora.target_modules`` adapts in the configured flavor (ours; a family read from
    its blocks: its modules' own), in the order given, then the family's."""
    spec, requested = get_model_spec(config.model.name), config.lora.target_modules
    blocks, _ = _meta_layers(config)
    held = [t.name for t in resolve_targets(spec, requested, blocks) if any(target_paths(b, [t]) for b in blocks)]
    order = {name: i for i, name in enumerate(requested)}
    return sorted(held, key=lambda name: order.get(name, len(order)))


def target_shapes(config: JobConfig) -> dict[str, tuple[int, int]]:
    """Our target name -> (out, in) of that linear in block 0 of the configured flavor (a dense family's every
    block; QLoRA's shape check)."""
    blocks, kinds = _meta_layers(config)
    return _first_kind(_kind_shapes(get_model_spec(config.model.name), config.lora.target_modules, blocks, kinds))


def adapted_shapes(config: JobConfig, n_layers: int) -> list[tuple[int, int]]:
    """(out, in) of every linear LoRA adapts in a model of ``n_layers`` blocks of the configured flavor: an MoE
    family's dense layers, MoE layers (attention, shared expert) each with their own; a family read from its
    blocks (``hf``) each layer's own, its schedule repeated past the flavor's depth."""
    blocks, kinds = _meta_layers(config)
    shapes = _kind_shapes(get_model_spec(config.model.name), config.lora.target_modules, blocks, kinds)
    return [shape for kind in _layer_kinds(config, n_layers) for shape in shapes[kind].values()]


def _layer_kinds(config: JobConfig, n_layers: int | None = None) -> list[int]:
    """Each layer's kind in the configured flavor at ``n_layers`` layers (default its own depth): 0 dense and 1 MoE,
    a hybrid's layer types (qwen3_5) in the order they first appear, or, in a family read from its blocks (``hf``),
    each layer of the flavor its own kind, repeated past its depth."""
    spec, args = get_model_spec(config.model.name), flavor_args(config.model)
    n = args.n_layers if n_layers is None else n_layers
    if spec.adapters.linears is not None:
        return [i % args.n_layers for i in range(n)]
    args = dataclasses.replace(args, n_layers=n)
    types = getattr(args, "layer_types", None)
    if types is not None:
        order = list(dict.fromkeys(types))
        return [order.index(t) for t in types]
    moe = getattr(args, "is_moe_layer", None)
    return [int(moe(i)) if moe is not None else 0 for i in range(n)]


def _meta_layers(config: JobConfig) -> tuple[list[nn.Module], list[int]]:
    """(blocks, kinds): a meta build of the configured flavor's first blocks, up to the first layer of its every kind,
    and each of its layers' kind (``_layer_kinds``)."""
    spec, args = get_model_spec(config.model.name), flavor_args(config.model)
    kinds = _layer_kinds(config)
    with torch.device("meta"):
        model = spec.model_cls(dataclasses.replace(args, n_layers=max(kinds.index(k) for k in set(kinds)) + 1))
    return [block for _, block in model_blocks(model)], kinds


def _kind_shapes(spec, requested: list[str], blocks: list[nn.Module], kinds: list[int]) -> dict:
    """Per layer kind: the block path -> (out, in) of the targets ``requested`` in its first block."""
    targets = resolve_targets(spec, requested, blocks)
    out: dict[int, dict[str, tuple[int, int]]] = {}
    for kind, block in zip(kinds, blocks):
        out.setdefault(kind, {p: tuple(block.get_submodule(p).weight.shape) for p in target_paths(block, targets)})
    return out


def _first_kind(shapes: dict[int, dict[str, tuple[int, int]]]) -> dict[str, tuple[int, int]]:
    """Our target name -> (out, in) in the first layer kind's block."""
    return {path.rsplit(".", 1)[-1]: shape for path, shape in shapes[min(shapes)].items()}


def _check_combinations(config: JobConfig, dims: ParallelDims) -> None:
    refusals = [
        (config.float8.enable_float8_linear, "float8.enable_float8_linear (a float8 base under LoRA)"),
        (
            dims.tp_enabled and config.experimental.enable_async_tensor_parallel,
            "experimental.enable_async_tensor_parallel",
        ),
        (config.optimizer.early_step_in_backward, "optimizer.early_step_in_backward"),
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


def _check_moe_layout(config: JobConfig, dims: ParallelDims) -> None:
    """LoRA on an MoE family runs in one process, under FSDP2 and expert parallel (the tested rows); the rest is
    refused (the dense families' TP/PP/CP rows do not cover the MoE blocks' plans)."""
    refusals = [
        (dims.tp_enabled, "training.tensor_parallel_degree > 1"),
        (dims.pp_enabled, "experimental.pipeline_parallel_degree > 1"),
        (dims.cp > 1, "experimental.context_parallel_degree > 1"),
    ]
    for refused, key in refusals:
        if refused:
            raise NotImplementedError(
                f"lora.enable with model.name = {config.model.name!r} and {key}: not built (no MoE LoRA row tests it); "
                "LoRA on MoE families runs in one process, under FSDP2 and expert parallel: drop that key"
            )
