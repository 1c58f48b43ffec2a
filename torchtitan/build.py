"""The build path shared by the trainer and the memory estimator: model, data loader, loss."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models import ModelArgs, model_name_to_cls, model_name_to_flavors
from torchtitan.distributed.init import init_model_weights
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import parallelize_llama

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.manager import JobConfig


def build_model_args(config: JobConfig, vocab_size: int) -> ModelArgs:
    """The flavor's args with the tokenizer's vocab, the training seq_len and the norm type (a new object)."""
    flavor = model_name_to_flavors[config.model.name][config.model.flavor]
    tp = config.training.tensor_parallel_degree
    if vocab_size % tp:
        raise ValueError(
            f"the tokenizer's vocabulary ({vocab_size} words, {config.model.tokenizer_path}) is not divisible by "
            f"training.tensor_parallel_degree = {tp}: TP shards the embedding and output over the vocabulary; "
            "choose a TP degree that divides it"
        )
    return dataclasses.replace(
        flavor, vocab_size=vocab_size, max_seq_len=config.training.seq_len, norm_type=config.model.norm_type
    )


def build_meta_model(config: JobConfig, model_args: ModelArgs) -> nn.Module:
    """The whole model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return model_name_to_cls[config.model.name](model_args)


def finish_model_part(
    part: nn.Module,
    config: JobConfig,
    parallel_dims: ParallelDims,
    world_mesh: DeviceMesh | None,
    device: torch.device,
) -> None:
    """Parallelize a meta model (or pipeline stage), materialise it on ``device``, init from the seed."""
    parallelize_llama(part, world_mesh, parallel_dims, config)
    # With FSDP CPU offload the sharded parameters live in CPU memory; FSDP copies them to the
    # device for each block's compute. Buffers (the RoPE table) stay on the device.
    offload = config.training.enable_cpu_offload and parallel_dims.fsdp_enabled
    part.to_empty(device=torch.device("cpu") if offload else device)
    seed = 0 if config.training.seed is None else config.training.seed
    init_model_weights(part, seed, buffer_device=device)
    part.train()


def build_model(
    config: JobConfig,
    model_args: ModelArgs,
    parallel_dims: ParallelDims,
    world_mesh: DeviceMesh | None,
    device: torch.device,
) -> nn.Module:
    """Build on the meta device, parallelize, materialise on ``device``, then init from the seed."""
    model = build_meta_model(config, model_args)
    finish_model_part(model, config, parallel_dims, world_mesh, device)
    return model


def build_pipeline_parts(
    config: JobConfig,
    whole: nn.Module,
    parallel_dims: ParallelDims,
    world_mesh: DeviceMesh,
    device: torch.device,
):
    """Split the meta model into this rank's pipeline stages, finish each, and build the schedule."""
    from torchtitan.distributed.pipeline import build_pipeline

    exp, accum = config.experimental, config.training.gradient_accumulation_steps

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The schedule averages over its micro-batches; accumulation steps average on top.
        return cross_entropy_loss(pred, labels) / accum

    return build_pipeline(
        whole,
        pp_mesh=world_mesh["pp"],
        device=device,
        n_microbatches=exp.pipeline_parallel_microbatches or parallel_dims.pp,
        local_batch_size=config.training.batch_size,
        schedule=exp.pipeline_parallel_schedule,
        split_points=exp.pipeline_parallel_split_points,
        csv_path=exp.pipeline_parallel_schedule_csv,
        loss_fn=loss_fn,
        finish_stage=lambda part: finish_model_part(part, config, parallel_dims, world_mesh, device),
    )


def num_non_embedding_params(model: nn.Module) -> int:
    """Global (unsharded) parameter count without the embedding table: what the matmuls touch."""
    total = sum(p.numel() for p in model.parameters())
    embed = getattr(model, "tok_embeddings", None)
    return total - (embed.weight.numel() if embed is not None else 0)


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss; logits are upcast to fp32 so a bf16 forward still gets an accurate loss."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
