"""The one build path of the model and its step: the trainer's, the estimator's, evaluation's and the seed's.

What it builds: model args, the meta model, the finished (parallelized, materialised, initialised) model
parts, the step function, the data loader. The engine (engine/parts.py) calls it in its ordered pass.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.checkpointing.common import model_info, save_model_weights
from torchtitan.checkpointing.files.marker import read_marker, step_folder
from torchtitan.checkpointing.files.storage import under
from torchtitan.checkpointing.hf.files import vocab_rows
from torchtitan.checkpointing.scope import WHOLE_MODEL
from torchtitan.checkpointing.state import ModelState
from torchtitan.components.loss import build_loss_fn
from torchtitan.components.step import PipelineLoss, StepFunction
from torchtitan.datasets.shard import DataShard
from torchtitan.datasets.tokenizer import build_tokenizer
from torchtitan.distributed.backend.device import get_device_info
from torchtitan.distributed.init import init_model_weights
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline.stages import PipelineParts, ShapeInference, build_pipeline
from torchtitan.dtypes import to_dtype
from torchtitan.features.mtp.step import build_mtp_step
from torchtitan.features.registry import build_slot, enabled_builders, model_transforms
from torchtitan.models.common.attention import resolve_attention_backend
from torchtitan.spec import chain_hooks, get_model_spec

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.components.seams import BatchFeed, ModelTransform
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Training
    from torchtitan.spec import ModelSpec, StepHooks


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
        from torchtitan.datasets.sft.finetune import build_sft_data_loader

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


@dataclasses.dataclass(frozen=True)
class ModelFeatures:
    """What the enabled features add to the model and its step (the registry's slots, resolved once a run)."""

    transforms: tuple[ModelTransform, ...] = ()
    """``model_transform``: applied to every model part, in the registry's order."""
    hooks: tuple[Callable[[JobConfig, list[nn.Module]], StepHooks], ...] = ()
    """``step_hooks``' builders, run over the finished model parts; chained after the family's hooks."""
    feed: Callable[..., BatchFeed] | None = None
    """``batch_feed``'s builder, or None: batches carry their tokens only."""


def model_features(
    config: JobConfig, spec: ModelSpec, device: torch.device, *, estimate: bool = False
) -> ModelFeatures:
    """The enabled features' transforms, step hooks and batch feed (``estimate``: the memory estimator's builders)."""
    feeds = enabled_builders(config, "batch_feed", estimate=estimate)
    return ModelFeatures(
        transforms=model_transforms(config, spec, device, estimate=estimate),
        hooks=tuple(build for _, build in enabled_builders(config, "step_hooks", estimate=estimate)),
        feed=feeds[0][1] if feeds else None,
    )


def finish_model_part(
    part: nn.Module,
    spec: ModelSpec,
    config: JobConfig,
    world: WorldMesh,
    device: torch.device,
    *,
    transforms: Sequence[ModelTransform] = (),
    frozen: bool = False,
) -> None:
    """Transform (``transforms``' ``convert``, in order), parallelize a meta model (or pipeline stage), materialise it
    on ``device``, init from the seed, then the transforms' ``after_init``.

    ``frozen``: no parameter is trained (the RL loop's reference): frozen before the parallelisms, so DDP, which
    only averages gradients, is not applied."""
    for transform in transforms:
        transform.convert(part)
    if frozen:
        part.requires_grad_(False)
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
    for transform in transforms:
        transform.after_init(part, seed)
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
    transforms: Sequence[ModelTransform] = (),
) -> tuple[list[nn.Module], PipelineParts | None]:
    """This rank's model parts: the whole model, or its pipeline stages (each from ``build_stage_model``,
    marking their shape-inference forwards in ``shape_inference``), finished with ``transforms``."""
    dims = world.dims
    if not dims.pp_enabled:
        finish_model_part(whole, spec, config, world, device, transforms=transforms)
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
        finish_stage=lambda part: finish_model_part(part, spec, config, world, device, transforms=transforms),
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
    features: ModelFeatures,
    eos_id: int,
    cp_positions: torch.Tensor | None,
) -> StepFunction:
    """This rank's finished model parts, the family's and the features' step hooks, and the one step function over
    them (with the features' batch feed over the parts; ``eos_id``: the tokenizer's end of document,
    ``cp_positions``: context parallel's positions of this rank, or None)."""
    loss_fn = build_loss_fn(compile=config.training.compile_loss)  # one loss for the schedule and the step
    shape_inference = ShapeInference()  # the stages mark it; the step hooks, the MTP loss and the batch feed read it
    # multi-token prediction (model.mtp_layers): the depths' loss beside the model's, and its metrics; else None
    depths = getattr(model_args, "mtp_layers", 0)
    mtp = build_mtp_step(loss_fn, config.training, depths=depths, world=world, device=device, inference=shape_inference)
    loss_fn = mtp or loss_fn
    pipeline_loss = PipelineLoss(loss_fn, aux_term=mtp.take_term if mtp is not None else None)
    parts, pipeline = build_model_parts(
        whole, build_stage_model, spec, config, world, device, pipeline_loss, shape_inference, features.transforms
    )
    hooks = None
    if spec.build_step_hooks is not None:
        hooks = spec.build_step_hooks(model_args, whole, parts, world, device, shape_inference=shape_inference)
    for build_hooks in features.hooks:
        hooks = chain_hooks(hooks, build_hooks(config, parts))
    hooks = chain_hooks(hooks, mtp)
    feed = None
    if features.feed is not None:
        feed = features.feed(
            parts,
            model=config.model,
            eos_id=eos_id,
            n_microbatches=pipeline.n_microbatches if pipeline is not None else 1,
            cp_positions=cp_positions,
            group=world.group("dp_cp"),
            shape_inference=shape_inference,
        )
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
        feed=feed,
        train_kwargs={"mtp": True} if mtp is not None else None,
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
    """A whole (non-pipelined) model of ``config.model.name``: meta build, the enabled features' transforms,
    parallelize, materialise, init."""
    spec = get_model_spec(config.model.name)
    model = build_meta_model(spec, model_args)
    transforms = model_transforms(config, spec, device)
    finish_model_part(model, spec, config, WorldMesh(parallel_dims, mesh), device, transforms=transforms)
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
    # a seed is a base: a run that trains part of the model (the checkpoint scope) draws that part again at every start
    scope = build_slot(config, "checkpoint_scope", WHOLE_MODEL, config)
    save_model_weights(
        ModelState(model, keys=scope.keys(full=False)).state_dict(),
        path,
        model_info(model=config.model, model_args=args),
    )
    logger.info("seed checkpoint written to %s", path)
    return path
