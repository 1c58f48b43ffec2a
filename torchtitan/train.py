"""The trainer: ``python -m torchtitan.train --job.config_file FILE [--section.key value ...]``.

Launch several processes with torchrun (see run_llama_train.sh); one process needs no launcher.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.build import (
    build_meta_model,
    build_model_args,
    build_pipeline_parts,
    cross_entropy_loss,
    finish_model_part,
    num_non_embedding_params,
)
from torchtitan.checkpointing import CheckpointManager, create_seed_checkpoint, model_info, trim_metrics
from torchtitan.components.loss import chunked_cross_entropy
from torchtitan.config.manager import JobConfig, format_help, wants_help
from torchtitan.observability.console import format_layout, format_start_summary
from torchtitan.datasets import build_hf_data_loader, build_tokenizer, compute_stream_groups
from torchtitan.components.load_balancing import ExpertLoadTracker
from torchtitan.observability.logging import init_logger
from torchtitan.models.moe import MoEArgs, num_active_params
from torchtitan.components.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.distributed.context_parallel import compute_cp_positions, shard_sequence
from torchtitan.distributed.fsdp import to_dtype
from torchtitan.distributed.grad_norm import clip_grad_norm_, reduce_partial_grads_
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline import pipeline_step
from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.observability.step_metrics import StepMetrics
from torchtitan.observability.run_records import write_run_records
from torchtitan.components.validation import Validator
from torchtitan.distributed.device import get_device_info, init_distributed, set_pg_timeout

logger = logging.getLogger(__name__)

# What a user can get wrong: shown as one line on rank 0, exit code 2. Anything else is a bug
# and keeps its traceback.
USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)


class Trainer:
    """Builds everything once from the config, then ``train()`` runs the loop."""

    def __init__(self, config: JobConfig, *, world_size: int, rank: int):
        self.config = config
        self.rank = rank
        self.device = get_device_info().device
        if world_size > 1 and not dist.is_initialized():  # the memory estimator brings its own (fake) group
            init_distributed(get_device_info(), config.comm.init_timeout_seconds)
        self.parallel_dims = ParallelDims.from_config(config, world_size)
        self.world_mesh = self._build_mesh()
        self.cp_positions = self._cp_positions()
        _set_determinism(config)
        tokenizer = self._build_tokenizer()
        self.data_loader = self._build_data_loader(tokenizer)
        self.model_args = build_model_args(config, tokenizer.n_words)
        whole = self._build_meta_model()
        num_params, num_flop_params = sum(p.numel() for p in whole.parameters()), num_non_embedding_params(whole)
        # MFU counts the parameters a token is multiplied by: for MoE, top_k of the routed experts
        mfu_params = num_active_params(self.model_args) if isinstance(self.model_args, MoEArgs) else num_flop_params
        moe_layers = list(whole.moe_layers()) if isinstance(self.model_args, MoEArgs) else []
        self.pipeline = None
        if self.parallel_dims.pp_enabled:
            self.pipeline = build_pipeline_parts(config, whole, self.parallel_dims, self.world_mesh, self.device)
            self.model_parts = self.pipeline.model_parts
        else:
            finish_model_part(whole, config, self.parallel_dims, self.world_mesh, self.device)
            self.model_parts = [whole]
        self.optimizer = build_optimizer(self.model_parts, config.optimizer)
        self.expert_load = None
        if moe_layers:
            self.expert_load = ExpertLoadTracker(moe_layers, self.model_args.num_experts, self.model_parts, self.device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.training)
        self.amp = self._autocast()
        self.loss_context = loss_parallel if self.parallel_dims.loss_parallel_enabled else contextlib.nullcontext
        self.step = 0
        self.checkpointer = self._build_checkpointer()
        # A resumed run continues at checkpoint step + 1; metrics.jsonl keeps the records up to it.
        self.step = self.start_step = self.checkpointer.load()
        if rank == 0 and self.step > 0:
            trim_metrics(config.job.dump_folder, self.step)
        self.metrics = self._build_metrics(mfu_params)
        self.validator = self._build_validator(tokenizer) if config.validation.enabled else None
        if rank == 0:
            logger.info("\n%s", self._start_summary(num_params, num_flop_params))

    # Build hooks: the memory estimator (torchtitan/estimation) overrides these hooks (and the data,
    # checkpoint and validator builders below), and only these,
    # to run this trainer's own build and step on fake tensors with no tokenizer file, data or output.
    def _build_mesh(self):
        return self.parallel_dims.build_mesh(self.device.type)

    def _build_meta_model(self) -> torch.nn.Module:
        return build_meta_model(self.config, self.model_args)

    def _build_tokenizer(self):
        return build_tokenizer(self.config.model.tokenizer_path)

    def _build_metrics(self, num_flop_params: int) -> StepMetrics:
        return StepMetrics(
            self.config,
            append=self.step > 0,
            device=self.device,
            enabled=self.rank == 0,
            loss_group=self._mesh_group("dp_cp"),
            pp_group=self._mesh_group("pp"),
            num_params=num_flop_params,
            model_args=self.model_args,
        )

    def _build_checkpointer(self) -> CheckpointManager:
        return CheckpointManager(
            self.config.checkpoint, dump_folder=self.config.job.dump_folder, model_parts=self.model_parts,
            optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, data_loader=self.data_loader,
            dp_rank=self._dp_coords()[0], rank=self.rank, device=self.device,
            model_info=model_info(self.config, self.model_args),
        )

    def _start_summary(self, num_params: int, num_flop_params: int) -> str:
        cfg, dims = self.config, self.parallel_dims
        return format_start_summary(
            model=f"{cfg.model.name} {cfg.model.flavor}", params=num_params, flop_params=num_flop_params,
            layout=format_layout({"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                                  "cp": dims.cp, "tp": dims.tp}),
            world_size=dims.world_size,
            global_batch=dims.dp_degree * cfg.training.batch_size * cfg.training.gradient_accumulation_steps,
            seq_len=cfg.training.seq_len, steps=cfg.training.steps, device=str(self.device),
            dump_folder=cfg.job.dump_folder,
        )

    def _dp_coords(self) -> tuple[int, int]:
        dp_axis = self.parallel_dims.axis_name("dp")
        return (0 if dp_axis is None else self.world_mesh[dp_axis].get_local_rank()), self.parallel_dims.dp_degree

    def _build_validator(self, tokenizer) -> Validator:
        dp_rank, dp_degree = self._dp_coords()
        return Validator(
            self.config, tokenizer, dp_rank=dp_rank, dp_degree=dp_degree, device=self.device,
            loss_context=self.loss_context, loss_group=self._mesh_group("dp_cp"), pp_group=self._mesh_group("pp"),
            pipeline=self.pipeline, shard_batch=self._shard_batch,
        )

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for part in self.model_parts for p in part.parameters()]

    def _mesh_group(self, flat_axis: str) -> dist.ProcessGroup | None:
        axis = self.parallel_dims.axis_name(flat_axis)
        return None if axis is None else self.world_mesh[axis].get_group()

    def _build_data_loader(self, tokenizer):
        t = self.config.training
        dp_rank, dp_degree = self._dp_coords()
        groups = compute_stream_groups(dp_rank, dp_degree, t.batch_size, t.gradient_accumulation_steps)
        num_streams = dp_degree * t.batch_size * t.gradient_accumulation_steps
        return build_hf_data_loader(t.dataset, t.dataset_path, tokenizer, t.seq_len, groups, num_streams)

    def _autocast(self):
        """FSDP applies mixed precision itself; without FSDP, autocast gives the same compute dtype."""
        dtype = to_dtype(self.config.training.mixed_precision_param)
        if self.parallel_dims.fsdp_enabled or dtype == torch.float32:
            return None
        return dtype

    def _next_batches(self, data_iter: Iterator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = []
        for _ in range(self.config.training.gradient_accumulation_steps):
            inputs, labels = next(data_iter)
            batches.append(self._shard_batch(inputs.to(self.device), labels.to(self.device)))
        return batches

    def _shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under context parallel, this rank's sequence positions of the batch its dp rank reads.

        The model gets the matching positions from the hook apply_cp installs, so RoPE rotates each
        token by its true position.
        """
        if self.cp_positions is None:
            return inputs, labels
        inputs, labels = shard_sequence([inputs, labels], seq_dim=1, positions=self.cp_positions)
        return inputs, labels

    def _cp_positions(self) -> torch.Tensor | None:
        dims, exp = self.parallel_dims, self.config.experimental
        if not dims.cp_enabled:
            return None
        cp_rank = self.world_mesh["cp"].get_local_rank()
        positions = compute_cp_positions(self.config.training.seq_len, dims.cp, cp_rank, exp.context_parallel_load_balance)
        return positions.to(self.device)

    def train_step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step. Returns (mean loss, grad norm), unsynced.

        Under pipeline parallel the loss is known only on the rank holding the last stage; other
        ranks return 0 and the metrics sum over the pipeline group.
        """
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in batches:
            # Dividing by the micro-batch count makes the accumulated gradient the gradient of the
            # mean (under PP the pipeline's loss function divides).
            loss = self._forward_backward(inputs, labels, scale=1.0 / len(batches))
            if loss is not None:
                loss_sum += _plain(loss)
        params = self.parameters()
        reduce_partial_grads_(params)
        pp_group = self._mesh_group("pp")
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm, extra_groups=[pp_group] if pp_group else [])
        self.optimizer.step()
        if self.expert_load is not None:  # global token counts: the expert bias update and the load metrics
            bias = self.model_args.load_balance == "bias"
            self.expert_load.finish_step(update_bias=bias, keep=self._is_log_step())
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor | None:
        autocast = torch.autocast(self.device.type, dtype=self.amp, enabled=self.amp is not None)
        if self.pipeline is not None:
            with autocast, self.loss_context():  # the schedule runs the loss and its backward inside
                return pipeline_step(self.pipeline, inputs, labels)
        chunk_size = self.config.training.loss_chunk_size
        if chunk_size > 0:
            model = self.model_parts[0]
            with autocast:
                hidden = model(inputs, return_hidden=True)  # (bs, seqlen, dim); Shard(1) DTensor under SP
            if isinstance(model, FSDPModule):
                # The root FSDP unit (which owns ``output``) resharded after forward; gather it again for
                # the loss. Its gradient is reduce-scattered by the root's post-backward, as usual.
                model.unshard()
            with self.loss_context():
                # The output projection runs per chunk inside the loss, under the forward's autocast
                # (checkpoint replays that autocast state when it recomputes a chunk in backward).
                with autocast:
                    loss = chunked_cross_entropy(hidden, model.output, labels, chunk_size=chunk_size) * scale
                del hidden
                self._backward(loss, scale)
            return loss
        with autocast:
            pred = self.model_parts[0](inputs)  # (bs, seqlen, vocab); vocab-sharded DTensor under loss parallel
        with self.loss_context():
            loss = cross_entropy_loss(pred, labels) * scale
            del pred
            self._backward(loss, scale)
        return loss

    def _backward(self, loss: torch.Tensor, scale: float) -> None:
        """Backward of the loss, plus the MoE aux loss (load_balance = "aux_loss") at the same scale.

        The aux loss is a per-rank regulariser on the rank's own tokens: FSDP averages it over the
        data-parallel ranks; TP ranks (each routing its own sequence shard) get 1/tp so the sum of
        their router grads is their mean. The logged loss stays the cross-entropy alone.
        """
        if self.expert_load is None or self.model_args.load_balance != "aux_loss":
            loss.backward()
            return
        aux = self.model_parts[0].aux_loss() * (scale / self.parallel_dims.tp)
        torch.autograd.backward([loss, aux])  # loss may be a DTensor (loss parallel), aux is not

    def _is_log_step(self) -> bool:
        cfg = self.config
        first = self.step == self.start_step + 1
        return first or self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps

    def train(self) -> None:
        cfg = self.config
        data_iter = iter(self.data_loader)
        gc.disable()  # collected every gc_freq steps instead, so pauses don't vary step to step
        trace_dir = os.path.join(cfg.job.dump_folder, cfg.profiling.save_traces_folder)
        snap_dir = os.path.join(cfg.job.dump_folder, cfg.profiling.save_memory_snapshot_folder)
        with (
            maybe_enable_profiling(
                cfg.profiling.enable_profiling, trace_dir=trace_dir, profile_freq=cfg.profiling.profile_freq,
                global_step=self.step, rank=self.rank,
            ) as profiler,
            maybe_enable_memory_snapshot(
                cfg.profiling.enable_memory_snapshot, snapshot_dir=snap_dir, profile_freq=cfg.profiling.profile_freq,
                device=self.device, global_step=self.step, rank=self.rank,
            ) as snapshotter,
        ):
            while self.step < cfg.training.steps:
                self.run_step(data_iter)
                for tool in (profiler, snapshotter):
                    if tool is not None:
                        tool.step()
        gc.enable()
        if self.rank == 0:
            logger.info(self.metrics.end_summary(self.step, checkpoint=self.checkpointer.summary()))

    def run_step(self, data_iter: Iterator) -> None:
        """One optimizer step: fetch the micro-batches, train on them, record metrics."""
        self.step += 1
        data_start = time.perf_counter()
        batches = self._next_batches(data_iter)
        self.metrics.add_data_time(time.perf_counter() - data_start)
        loss, grad_norm = self.train_step(batches)
        self._after_step(loss, grad_norm)

    def _after_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        cfg = self.config
        # This rank's share of the step's tokens: TP, CP and PP ranks split the work on the same
        # samples, so tokens/s and MFU are per-rank numbers that add up across the world.
        dims = self.parallel_dims
        samples = cfg.training.batch_size * cfg.training.gradient_accumulation_steps
        tokens = samples * cfg.training.seq_len / (dims.tp * dims.cp * dims.pp)
        self.metrics.add_step(tokens)
        first = self.step == self.start_step + 1
        if self._is_log_step():
            expert_load = self.expert_load.last if self.expert_load is not None else None
            self.metrics.log(self.step, loss, grad_norm, lr=self.lr_scheduler.get_last_lr()[0], expert_load=expert_load)
        v = cfg.validation
        if self.validator is not None and (self.step % v.freq == 0 or self.step == cfg.training.steps):
            self.metrics.log_validation(self.step, self.validator.run(self.model_parts))
        self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
        if first:
            set_pg_timeout(cfg.comm.train_timeout_seconds)
        if self.step % cfg.training.gc_freq == 0:
            gc.collect(1)

    def close(self) -> None:
        self.checkpointer.close()  # waits for an async save in flight
        self.metrics.close()


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor (loss parallel returns a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _set_determinism(config: JobConfig) -> None:
    torch.manual_seed(0 if config.training.seed is None else config.training.seed)
    if config.training.deterministic:
        # Deterministic cuBLAS needs a fixed workspace; read when the first CUDA matmul runs.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def run_job(config: JobConfig, *, world_size: int, rank: int) -> None:
    """Validate, build, train. Joins the process group if none exists and leaves it as it is.

    A launcher that runs several jobs in one set of processes (tests/batch_runs.py) calls this
    once per job under one process group.
    """
    for warning in config.validate(world_size):
        if rank == 0:
            logger.warning(warning)
    os.makedirs(config.job.dump_folder, exist_ok=True)
    if rank == 0:
        write_run_records(config, world_size)
        if config.job.print_args:
            logger.info("resolved config:\n%s", config.to_toml())
    if config.checkpoint.create_seed_checkpoint:
        create_seed_checkpoint(config)
        return
    trainer = Trainer(config, world_size=world_size, rank=rank)
    try:
        trainer.train()
    finally:
        trainer.close()


def run(config: JobConfig, *, world_size: int, rank: int) -> None:
    """``run_job``, then always leave the process group destroyed."""
    try:
        run_job(config, world_size=world_size, rank=rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(format_help())
        return 0
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    init_logger()
    try:
        run(JobConfig.parse_args(argv), world_size=world_size, rank=rank)
    except USER_ERRORS as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        if os.environ.get("TORCHTITAN_TRACEBACK"):
            traceback.print_exc()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
