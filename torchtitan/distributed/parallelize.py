"""The one composition of parallelisms (llama-style models: ``layers`` of blocks, embedding, norm, output)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.distributed.activation_checkpoint import apply_ac, compile_backend
from torchtitan.distributed.context_parallel.context_parallel import apply_cp, compute_cp_positions
from torchtitan.distributed.context_parallel.torch_context_parallel import apply_torch_cp
from torchtitan.distributed.expert_parallel.experts import apply_ep
from torchtitan.distributed.expert_parallel.moe_balance import apply_global_balance
from torchtitan.distributed.fsdp import apply_ddp, apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel.checks import resolve_async_tp
from torchtitan.distributed.tensor_parallel.module_styles import with_module_styles
from torchtitan.distributed.tensor_parallel.plan import apply_tp, frozen_names, refreeze
from torchtitan.distributed.tensor_parallel.replicated import inputs_replicated, outputs_local, replicate_own
from torchtitan.dtypes import to_dtype
from torchtitan.models.moe.moe import GroupedExperts

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.schema import ActivationCheckpoint, Experimental, Float8, Training

logger = logging.getLogger(__name__)


def apply_compile(
    model: nn.Module, *, tp_enabled: bool, backend: str | Callable = "inductor", cuda_graphs: bool = False
) -> None:
    """Compile each block separately (with ``backend``: activation_checkpoint.py's ``compile_backend``): blocks are
    identical, so one compiled graph is reused by all.

    A dense block compiles whole (``fullgraph``: any graph break is an error); with ``cuda_graphs``
    (``training.cuda_graphs``) in ``mode="reduce-overhead"``, its kernels recorded as CUDA graphs and replayed each
    step (features/cuda_graphs/checks.py: where that is built). An image model's tower block compiles around its
    per-frame attention, eager like the experts, never with CUDA graphs (its shapes follow the images). An MoE block
    compiles around its routed experts: each MoE's ``routed_experts`` (the token permutation, the grouped matmul
    and, under expert parallel, the all-to-all) runs in eager mode (``torch.compiler.disable``), a clean break before
    and after it; the router, the aux loss, the shared expert, attention and the norms compile. The grouped matmul has
    no fp32 kernel under fake tensors, and EP's splits are data-dependent.
    """
    for name, block in list(model.layers.items()):
        moes = [m for m in block.modules() if isinstance(getattr(m, "experts", None), GroupedExperts)]
        for moe in moes:
            moe.routed_experts = torch.compiler.disable(moe.routed_experts)
        # the preflight refuses CUDA graphs with MoE and with a memory budget (a backend of its own)
        mode = {"mode": "reduce-overhead"} if cuda_graphs and not moes else {}
        model.layers[name] = torch.compile(block, fullgraph=not moes, backend=backend, **mode)
    if getattr(model, "visual", None) is not None:
        compile_tower_blocks(model.visual, backend=backend)
    if tp_enabled and model.tok_embeddings is not None:
        # A compiled block whose input is a view of a DTensor's local tensor (the TP embedding's
        # output) gets a plain-tensor gradient back and DTensor's backward fails (torch 2.13);
        # a copy makes the compiled region's input a non-view. Cheap: one activation per step.
        model.tok_embeddings.register_forward_hook(lambda mod, inputs, out: out.clone())


def compile_tower_blocks(tower: nn.Module, backend: str | Callable = "inductor") -> None:
    """An image model's tower blocks compile around their per-frame attention (one call a frame: the calls follow the
    batch's images), which runs eagerly: each block's tensor-only steps before it (``attend_inputs``: the norm, q/k/v,
    RoPE) and after it (``finish``: the projection, the residuals, the MLP) compile, the patches' count dynamic, so
    batches of other images reuse the graphs; no frame length enters a graph (no guard on it)."""
    for block in tower.blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)  # under activation checkpointing's wrapper
        inner.attend_inputs = torch.compile(inner.attend_inputs, dynamic=True, backend=backend)
        inner.finish = torch.compile(inner.finish, dynamic=True, backend=backend)


def pass_positions(model: nn.Module, positions: torch.Tensor) -> None:
    """Make the model's forward receive ``positions`` (its tokens' places in the whole sequence).

    Under context parallel each rank holds a fixed, non-contiguous slice of every sequence (the
    trainer cuts inputs and labels with the same positions); RoPE must rotate each token by its
    true position. A forward pre-hook keeps the call sites (trainer, validator, pipeline
    schedules, whose stages get only hidden states) unaware of it.
    """
    on_device: dict[torch.device, torch.Tensor] = {}

    def add_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs["tokens"]
        if x.device not in on_device:
            on_device[x.device] = positions.to(x.device)
        return args, {**kwargs, "positions": on_device[x.device]}

    model.register_forward_pre_hook(add_positions, with_kwargs=True)


def enable_compiler_async_tp(tp_mesh: DeviceMesh) -> None:
    """torch's async TP: symmetric memory for the TP group + inductor's micro-pipeline TP pass."""
    from torch.distributed import _symmetric_memory as symm_mem

    if tp_mesh.device_type == "cpu" or symm_mem.get_backend(tp_mesh.device_type) is None:
        raise NotImplementedError(
            f"experimental.async_tensor_parallel_impl = 'compiler' needs symmetric memory, which torch "
            f"{torch.__version__} does not provide on device '{tp_mesh.device_type}'; use 'ring' (any backend)"
        )
    torch._inductor.config._micro_pipeline_tp = True
    symm_mem.enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def _experts_fsdp_mesh(world_mesh: DeviceMesh, parallel_dims: ParallelDims) -> DeviceMesh | None:
    """Under EP, the experts' FSDP mesh: dp_shard_mod_ep (kept even at size 1), with dp_replicate for HSDP."""
    if not parallel_dims.ep_enabled:
        return None
    dims = ("dp_replicate", "dp_shard_mod_ep") if parallel_dims.dp_replicate_enabled else ("dp_shard_mod_ep",)
    return world_mesh[dims]


def parallelize(
    model: nn.Module,
    *,
    world_mesh: DeviceMesh | None,
    parallel_dims: ParallelDims,
    training: Training,
    experimental: Experimental,
    activation_checkpoint: ActivationCheckpoint,
    float8: Float8,
) -> None:
    """Apply, in place and in this order: TP, EP, CP, activation checkpointing, compile, then FSDP/HSDP or DDP.

    Why this order: TP first because it rewrites each linear's parameters into DTensors and its
    plan addresses the model's own module names, which wrappers would change (on MoE blocks it
    parallelizes attention, router and shared expert, not the experts); EP then shards each MoE's
    experts over the "ep" axis (dp_shard_in_ep x tp), also by module (then the MoE aux loss gets its sum over the
    ranks, moe_balance.py: no parameters, so anywhere before FSDP would do); CP swaps each
    attention's core (no parameters) for ring attention, also by module name; AC wraps each
    (TP'd) block before compile so the compiled graph contains the recomputation policy; compile
    before FSDP so FSDP's hooks stay outside the compiled region (its communication is not traced);
    data parallelism last because its unit is the finished (TP'd, wrapped, compiled) block, and
    FSDP over TP DTensors gives 2-D parameters (dp_shard, tp); under EP each MoE's experts are
    their own FSDP unit over dp_shard_mod_ep, giving (dp_shard_mod_ep, ep) parameters.
    """
    if parallel_dims.tp_enabled:
        _apply_tp(model, world_mesh["tp"], parallel_dims, experimental=experimental, training=training, float8=float8)
    if parallel_dims.ep_enabled:
        apply_ep(model, world_mesh[parallel_dims.axis_name("ep")], tp=parallel_dims.tp)
        logger.info("applied expert parallel over %d ranks (%d of them TP ranks)", parallel_dims.ep, parallel_dims.tp)
    if training.moe_aux_loss_scope == "global_micro_batch":
        apply_global_balance(model, parallel_dims)  # the MoE aux loss over every rank's tokens
    if parallel_dims.cp_enabled:
        _apply_cp(model, world_mesh["cp"], parallel_dims, experimental=experimental, seq_len=training.seq_len)
    apply_ac(model, activation_checkpoint)
    if getattr(model, "visual", None) is not None:  # an image model's tower blocks, by the same mode
        apply_ac(model, activation_checkpoint, blocks=model.visual.blocks)
    if training.compile:
        apply_compile(
            model,
            tp_enabled=parallel_dims.tp_enabled,
            backend=compile_backend(activation_checkpoint),
            cuda_graphs=training.cuda_graphs,
        )
    if parallel_dims.fsdp_enabled:
        _apply_fsdp(model, world_mesh, parallel_dims, training=training, blocks=_units(model))
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, world_mesh["dp_replicate"])


def _apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    *,
    experimental: Experimental,
    training: Training,
    float8: Float8,
) -> None:
    async_tp = resolve_async_tp(experimental=experimental, compile=training.compile, device_type=tp_mesh.device_type)
    apply_tp(
        model,
        tp_mesh,
        loss_parallel=parallel_dims.loss_parallel_enabled,
        ring_async=async_tp == "ring",
        float8=_float8_tp_styles(float8, tp_mesh, param_dtype=training.mixed_precision_param),
    )
    if async_tp == "compiler":
        enable_compiler_async_tp(tp_mesh)
    logger.info("applied tensor parallel over %d ranks (async: %s)", parallel_dims.tp, async_tp or "off")


def _float8_tp_styles(f8: Float8, tp_mesh: DeviceMesh, *, param_dtype: str) -> bool:
    """Whether TP uses torchao's float8 styles (all-gathers in float8): tensorwise linears, a float8-capable backend.

    Rowwise-scaled linears take the plain styles (torchao's float8 styles are tensorwise); gloo has no
    float8 dtypes, so there the all-gathers move high precision and the GEMMs are still float8.
    """
    if not f8.enable_float8_linear or f8.recipe_name != "tensorwise":
        return False
    backend = torch.distributed.get_backend(tp_mesh.get_group())
    if backend == "gloo":
        logger.info(
            "float8 with TP on gloo: its collectives have no float8 dtypes, so TP's all-gathers move %s "
            "(the GEMMs are float8); on NCCL torchao's float8 styles all-gather float8",
            param_dtype,
        )
        return False
    return True


def _apply_cp(
    model: nn.Module, cp_mesh: DeviceMesh, parallel_dims: ParallelDims, *, experimental: Experimental, seq_len: int
) -> None:
    exp = experimental
    apply = apply_torch_cp if exp.context_parallel_impl == "torch" else apply_cp
    apply(
        model, cp_mesh, rotate_method=exp.context_parallel_rotate_method, load_balance=exp.context_parallel_load_balance
    )
    positions = compute_cp_positions(
        seq_len, parallel_dims.cp, cp_mesh.get_local_rank(), exp.context_parallel_load_balance
    )
    pass_positions(model, positions)
    logger.info(
        "applied context parallel over %d ranks (%s ring attention, %s, load balance %s)",
        parallel_dims.cp,
        exp.context_parallel_impl,
        exp.context_parallel_rotate_method,
        exp.context_parallel_load_balance,
    )


def _units(model: nn.Module) -> list[nn.Module] | None:
    """FSDP's units in forward order: an image model's tower blocks, then the tower itself (patch embedding, positions,
    merger), then the blocks, then each multi-token-prediction depth (``mtp``: its experts then get their own unit
    under EP, as a block's); None (the blocks) for a text model without depths."""
    tower, mtp = getattr(model, "visual", None), getattr(model, "mtp", None)
    if tower is None and mtp is None:
        return None
    return [*((*tower.blocks, tower) if tower is not None else ()), *model.layers.values(), *(mtp or {}).values()]


def _apply_fsdp(
    model: nn.Module,
    world_mesh: DeviceMesh,
    parallel_dims: ParallelDims,
    *,
    training: Training,
    blocks: list[nn.Module] | None = None,
) -> None:
    shard_axis = parallel_dims.axis_name("dp_shard_cp")
    dims = ("dp_replicate", shard_axis) if parallel_dims.dp_replicate_enabled else (shard_axis,)
    apply_fsdp(
        model,
        world_mesh[dims],
        param_dtype=to_dtype(training.mixed_precision_param),
        reduce_dtype=to_dtype(training.mixed_precision_reduce),
        reshard_after_forward=training.fsdp_reshard_after_forward,
        prefetch_depth=training.fsdp_prefetch_depth,
        cpu_offload=training.enable_cpu_offload,
        # pinned host memory speeds up host<->device copies; there are none on a CPU device
        pin_memory=world_mesh.device_type != "cpu",
        experts_mesh=_experts_fsdp_mesh(world_mesh, parallel_dims),
        blocks=blocks,
    )
    if training.enable_cpu_offload and world_mesh.device_type == "cpu":
        logger.warning(
            "training.enable_cpu_offload on a CPU device: parameters already live in CPU memory, "
            "so offloading saves nothing here (it applies on accelerators)"
        )


# -- transformers' own models (model.name = "hf", models/hf/): the decoder's layers are the units of FSDP, activation
# checkpointing and compile, found generically; TP follows the model's own base_model_tp_plan. The same order as above;
# pipeline and context parallel are refused by the family's check.


def _style(style: str) -> ParallelStyle | None:
    """torch's ParallelStyle for a transformers TP plan entry; None for one not built here."""
    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        # the full output on every rank (a fused projection whose halves must not be split across ranks)
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        # a replicated input, split here along its last dim
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # a weight applied to this rank's heads only (QK-norm after a colwise projection): replicated, its
        # gradient summed over the TP ranks. The input is marked sharded on dim 0 for that: the norm is over the
        # last dim, so which dim is named changes nothing but the gradient's reduction.
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
    }.get(style, lambda: None)()


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The decoder's TP plan (``base_model_tp_plan``: keys relative to the decoder, ``layers.*.`` per layer)."""
    return dict(getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {})


def apply_hf_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Each decoder layer by the model's plan; every other parameter (embedding, norms, head) replicated.

    The replicated ones become Replicate DTensors whose module takes and returns plain tensors, so every parameter
    of the model is a DTensor on the TP mesh (the optimizer's foreach step and the gradient norm take no mix). Their
    inputs and gradients are the same on every TP rank: the plan's styles leave the hidden state replicated between
    them.
    """
    plan, frozen = tp_plan(model), frozen_names(model)
    keys = [key.removeprefix("layers.*.") for key in plan]
    for layer in model.decoder_layers:
        styles = {key: _style(plan[f"layers.*.{key}"]) for key in keys}
        parallelize_module(layer, tp_mesh, with_module_styles(styles, layer))  # e.g. LoRA's: adapters alike
    refreeze(model, frozen)
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, replicate_own, inputs_replicated, outputs_local)


def parallelize_hf(
    model: nn.Module,
    *,
    world_mesh: DeviceMesh | None,
    parallel_dims,
    training,
    experimental,
    activation_checkpoint,
    float8,
) -> None:
    """Every parallelism of ``parallel_dims`` on a transformers model, in place (``ModelSpec.parallelize_fn``)."""
    if parallel_dims.tp_enabled:
        apply_hf_tp(model, world_mesh["tp"])
    layers = model.decoder_layers
    apply_ac(model, activation_checkpoint, blocks=layers)
    if training.compile:
        backend = compile_backend(activation_checkpoint)
        for layer in layers:
            layer.compile(backend=backend)  # in place: the layer keeps its name (no _orig_mod in checkpoints)
    if parallel_dims.fsdp_enabled:
        _apply_fsdp(model, world_mesh, parallel_dims, training=training, blocks=list(layers))
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, world_mesh["dp_replicate"])
