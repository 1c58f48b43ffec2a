"""The one build path of the model and its step, shared by the trainer, the memory estimator, evaluation and
the seed checkpoint: model args, the meta model, the finished (parallelized, materialised, initialised) model
parts, the step function, the data loader. The engine (engine/parts.py) calls it in its ordered pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.checkpointing.common import model_info, save_model_weights
from torchtitan.checkpointing.hf_files import vocab_rows
from torchtitan.checkpointing.marker import read_marker, step_folder
from torchtitan.checkpointing.state import ModelState
from torchtitan.checkpointing.storage import under
from torchtitan.components.loss import build_loss_fn
from torchtitan.components.step import PipelineLoss, StepFunction
from torchtitan.datasets.shard import DataShard
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed.backend.device import get_device_info
from torchtitan.distributed.init import cast_parameters_, init_model_weights
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline.stages import PipelineParts, ShapeInference, build_pipeline
from torchtitan.dtypes import to_dtype
from torchtitan.features.documents.feed import build_document_feed
from torchtitan.features.float8.float8 import (
    Float8ScalePrecompute,
    apply_float8,
    check_float8_runs,
    cpu_float8_onednn_problem,
    turn_off_onednn,
)
from torchtitan.features.linear_attention import install_linear_attention_kernel
from torchtitan.lora.apply import apply_lora, init_lora_adapters
from torchtitan.lora.linear import is_base_key
from torchtitan.models.common.attention import resolve_attention_backend
from torchtitan.spec import chain_hooks, get_model_spec

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Training
    from torchtitan.spec import ModelSpec


def build_model_args(config: JobConfig, spec: ModelSpec, vocab_size: int, *, device_type: str | None = None) -> Any:
    """The flavor's args with the tokenizer's vocab (``vocab_size``: its words; the rows of the model config the run
    names where it names one, see ``vocab_rows``), the training seq_len, the norm type and the attention backend (a
    new object).

    ``device_type``: the run's device, which ``model.attention_backend = 'auto'`` resolves against;
    default the device this process trains on (``get_device_info``), as the trainer's.
    """
    flavor = spec.flavor_args(config.model)
    vocab_size = vocab_rows(config, spec, vocab_size)
    if config.model.norm_type == "fused_rmsnorm":
        _log_fused_rmsnorm_once()
    args = dataclasses.replace(
        flavor, vocab_size=vocab_size, max_seq_len=config.training.seq_len, norm_type=config.model.norm_type
    )
    if not spec.documents:
        return args  # a family without document masking has no attention backend to choose
    device_type = device_type or get_device_info().device.type
    backend = resolve_attention_backend(config.model.attention_backend, device_type)
    return dataclasses.replace(args, attention_backend=backend)


@functools.cache
def _log_fused_rmsnorm_once() -> None:
    logger.info(
        "model.norm_type = 'fused_rmsnorm': nn.RMSNorm, as for 'rmsnorm' (torch %s runs aten::_fused_rms_norm for "
        "both; on Hopper/Blackwell CUDA its quack kernel); checkpoints of either load into the other",
        torch.__version__,
    )


def build_meta_model(spec: ModelSpec, model_args: Any) -> nn.Module:
    """The whole model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return spec.model_cls(model_args)


def build_data_loader(training: Training, tokenizer: Any, shard: DataShard, model_args: Any = None) -> Iterable:
    """This data-parallel rank's slice of every global batch (see docs/data.md); ``model_args``: the model's (image
    data reads its vision tower)."""
    # The data stack (datasets, torchdata) loads only for a run that reads data: tools that build the
    # trainer with synthetic batches (the estimator, bench/gpu_check.py) run without it installed.
    from torchtitan.datasets.hf_datasets import compute_stream_groups
    from torchtitan.datasets.text_loader import build_text_data_loader

    t = training
    groups = compute_stream_groups(shard.rank, shard.degree, t.batch_size, t.gradient_accumulation_steps)
    num_streams = shard.degree * t.batch_size * t.gradient_accumulation_steps
    if t.dataset_format != "text":  # fine-tuning rows, packed (datasets/sft/loader.py)
        from torchtitan.datasets.finetune import build_sft_data_loader

        return build_sft_data_loader(t.dataset, t.dataset_path, tokenizer, t, groups, num_streams, model_args)
    return build_text_data_loader(
        t.dataset,
        t.dataset_path,
        tokenizer,
        t.seq_len,
        groups,
        num_streams,
        mix=t.dataset_mix,
        seed=t.seed or 0,
        restart_mix=t.dataset_mix_restart,
    )


def finish_model_part(
    part: nn.Module,
    spec: ModelSpec,
    config: JobConfig,
    world: WorldMesh,
    device: torch.device,
    *,
    frozen: bool = False,
) -> None:
    """Float8-convert or add LoRA adapters (if asked), parallelize a meta model (or pipeline stage), materialise it on ``device``, init
    from the seed. The float8 conversion comes first: TP picks float8 styles for converted linears.

    ``frozen``: no parameter is trained (the RL loop's reference): frozen before the parallelisms, so DDP, which
    only averages gradients, is not applied."""
    if config.float8.enable_float8_linear:
        check_float8_runs(device, config.float8.recipe_name)
        if device.type == "cpu" and (problem := cpu_float8_onednn_problem()) is not None:
            turn_off_onednn(problem)  # the probes measure; the build decides for the process
        apply_float8(part, config.float8)
    install_linear_attention_kernel(part, config.model.linear_attention_kernel, device)  # Gated DeltaNet's, if any
    if config.lora.enable:  # adapters on the frozen base, before TP so each adapter is sharded like its linear
        apply_lora(part, config.lora, spec)
    if config.training.dtype != "float32":  # before FSDP/TP wrap them: every layout holds the same bf16 tensors
        cast_parameters_(part, to_dtype(config.training.dtype))
    if frozen:
        part.requires_grad_(False)
    elif config.model.freeze_vision:  # the family's check allows it only on a model with a tower
        part.freeze_vision()
    spec.parallelize_fn(
        part,
        world_mesh=world.mesh,
        parallel_dims=world.dims,
        training=config.training,
        experimental=config.experimental,
        activation_checkpoint=config.activation_checkpoint,
        float8=config.float8,
    )
    # With FSDP CPU offload the sharded parameters live in CPU memory; FSDP copies them to the
    # device for each block's compute. Buffers (the RoPE table) stay on the device.
    offload = config.training.enable_cpu_offload and world.dims.fsdp_enabled
    part.to_empty(device=torch.device("cpu") if offload else device)
    seed = 0 if config.training.seed is None else config.training.seed
    init_model_weights(part, seed, buffer_device=device)
    if config.lora.enable:
        init_lora_adapters(part, seed)
    part.train()


def build_model_parts(
    whole: nn.Module,
    build_stage_model: Callable[[], nn.Module],
    spec: ModelSpec,
    config: JobConfig,
    world: WorldMesh,
    device: torch.device,
    loss_fn: PipelineLoss,
    shape_inference: ShapeInference,
) -> tuple[list[nn.Module], PipelineParts | None]:
    """This rank's model parts: the whole model, or its pipeline stages (each from ``build_stage_model``,
    marking their shape-inference forwards in ``shape_inference``)."""
    dims = world.dims
    if not dims.pp_enabled:
        finish_model_part(whole, spec, config, world, device)
        return [whole], None
    if spec.pipeline_split_fn is None:
        raise NotImplementedError(
            f"experimental.pipeline_parallel_degree = {dims.pp} with model.name = {spec.name!r}: this model "
            "family has no pipeline split; use pipeline_parallel_degree = 1"
        )
    exp = config.experimental
    pipeline = build_pipeline(
        build_stage_model,
        n_layers=whole.args.n_layers,
        split_fn=spec.pipeline_split_fn,
        pp_mesh=world.get("pp"),
        device=device,
        n_microbatches=exp.pipeline_parallel_microbatches or dims.pp,
        local_batch_size=config.training.batch_size,
        schedule=exp.pipeline_parallel_schedule,
        split_points=exp.pipeline_parallel_split_points,
        csv_path=exp.pipeline_parallel_schedule_csv,
        loss_fn=loss_fn,
        finish_stage=lambda part: finish_model_part(part, spec, config, world, device),
        shape_inference=shape_inference,
    )
    return pipeline.model_parts, pipeline


def build_step_function(
    whole: nn.Module,
    build_stage_model: Callable[[], nn.Module],
    spec: ModelSpec,
    model_args: Any,
    config: JobConfig,
    world: WorldMesh,
    device: torch.device,
    *,
    eos_id: int,
    cp_positions: torch.Tensor | None,
) -> StepFunction:
    """This rank's finished model parts, the family's step hooks, and the one step function over them
    (block_causal: with the feed of each batch's documents over the parts; ``eos_id``: the tokenizer's end
    of document, ``cp_positions``: context parallel's positions of this rank, or None)."""
    loss_fn = build_loss_fn(compile=config.training.compile_loss)  # one loss for the schedule and the step
    pipeline_loss = PipelineLoss(loss_fn)
    shape_inference = ShapeInference()  # the stages mark it; the step hooks and the document feed read it
    parts, pipeline = build_model_parts(
        whole, build_stage_model, spec, config, world, device, pipeline_loss, shape_inference
    )
    hooks = None
    if spec.build_step_hooks is not None:
        hooks = spec.build_step_hooks(model_args, whole, parts, world, device, shape_inference=shape_inference)
    if config.float8.precompute_float8_dynamic_scale_for_fsdp:
        hooks = chain_hooks(hooks, Float8ScalePrecompute(parts))
    return StepFunction(
        parts,
        world=world,
        device=device,
        amp_dtype=autocast_dtype(config.training, world.dims),
        loss_fn=loss_fn,
        loss_chunk_size=config.training.loss_chunk_size,
        pipeline=pipeline,
        pipeline_loss=pipeline_loss,
        hooks=hooks,
        feed=build_document_feed(
            parts,
            model=config.model,
            eos_id=eos_id,
            n_microbatches=pipeline.n_microbatches if pipeline is not None else 1,
            cp_positions=cp_positions,
            group=world.group("dp_cp"),
            shape_inference=shape_inference,
        ),
    )


def autocast_dtype(training: Training, dims: ParallelDims) -> torch.dtype | None:
    """The step's autocast dtype: FSDP applies mixed precision itself; without FSDP, autocast gives the same
    compute dtype; None in fp32, and with bf16 parameters (training.dtype), which compute in bf16 as they are."""
    dtype = to_dtype(training.mixed_precision_param)
    pure = training.dtype != "float32"
    return None if dims.fsdp_enabled or pure or dtype == torch.float32 else dtype


def build_model(
    config: JobConfig, model_args: Any, parallel_dims: ParallelDims, mesh: DeviceMesh | None, device: torch.device
) -> nn.Module:
    """A whole (non-pipelined) model of ``config.model.name``: meta build, parallelize, materialise, init."""
    spec = get_model_spec(config.model.name)
    model = build_meta_model(spec, model_args)
    finish_model_part(model, spec, config, WorldMesh(parallel_dims, mesh), device)
    return model


def create_seed_checkpoint(config: JobConfig) -> str:
    """Build and initialise the model in this one process, save it as ``step-0`` (weights only)."""
    path = step_folder(under(config.job.dump_folder, config.checkpoint.folder), 0)
    if read_marker(path) is not None:
        raise ValueError(f"checkpoint.create_seed_checkpoint: {path} already exists; delete it to make a new seed")
    spec = get_model_spec(config.model.name)
    args = build_model_args(config, spec, build_tokenizer(config.model.tokenizer_path).n_words)
    model = build_model(
        config,
        args,
        ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=1),
        None,
        get_device_info().device,
    )
    # a seed is a base: with LoRA, its adapters are drawn again from the seed at every start
    save_model_weights(
        ModelState(model, keys=is_base_key).state_dict(), path, model_info(model=config.model, model_args=args)
    )
    logger.info("seed checkpoint written to %s", path)
    return path
