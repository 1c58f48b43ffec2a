"""The trainer: ``python -m torchtitan.train --job.config_file FILE [--section.key value ...]``.

Launch several processes with torchrun (see run_llama_train.sh); one process needs no launcher.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from torchtitan.build import TrainerBuilders, build_step_function, create_seed_checkpoint
from torchtitan.checkpointing.common import model_info
from torchtitan.checkpointing.manager import CheckpointManager, resumes_from
from torchtitan.components.document_feed import Batch
from torchtitan.components.optimizer import apply_optimizer_config, build_lr_scheduler, build_optimizer
from torchtitan.components.run_control import NonFiniteStep, RunStopped, StepGuard, StopSignals
from torchtitan.components.step import StepFunction
from torchtitan.components.validation import Validator
from torchtitan.config.manager import JobConfig, format_help, wants_help
from torchtitan.datasets.sft.packing import PackedDocs
from torchtitan.distributed.context_parallel import compute_cp_positions, shard_sequence
from torchtitan.distributed.device import get_device_info, init_distributed, set_determinism, set_pg_timeout
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.dtypes import to_dtype
from torchtitan.launch.failures import report_exception, report_failure
from torchtitan.launch.parent_watch import watch_parent
from torchtitan.launch.run_folder import RunLock, set_aside_earlier_run
from torchtitan.observability.console import format_layout, format_start_summary
from torchtitan.observability.logging import init_logger
from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.observability.run_records import run_record_names, write_run_records
from torchtitan.observability.step_metrics import StepMetrics
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec

logger = logging.getLogger(__name__)

# What a user can get wrong: one line (printed by the launcher, with the ranks that raised it), exit code 2;
# so are storage errors (disk full, read-only folder). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)


class Trainer:
    """Builds everything once from the config, then ``train()`` runs the loop.

    ``builders`` swaps the parts that touch the outside world (see ``build.TrainerBuilders``); the
    memory estimator passes fakes there and runs this same build and step.
    """

    def __init__(self, config: JobConfig, *, world_size: int, rank: int, builders: TrainerBuilders | None = None):
        self.config, self.rank = config, rank
        self.builders = b = _with_trainer_defaults(builders or TrainerBuilders())
        self.device = get_device_info().device
        if world_size > 1 and not dist.is_initialized():  # the memory estimator brings its own (fake) group
            init_distributed(get_device_info(), config.comm.init_timeout_seconds, config.comm.trace_buf_size)
        self.spec = get_model_spec(config.model.name)
        self.parallel_dims = ParallelDims.from_sections(
            training=config.training, experimental=config.experimental, world_size=world_size
        )
        self.world = WorldMesh(self.parallel_dims, b.mesh(self.parallel_dims, self.device.type))
        self.cp_positions = self._cp_positions()
        set_determinism(config.training.seed, config.training.deterministic)
        tokenizer = b.tokenizer(config.model)
        self.data_loader = b.data_loader(config.training, tokenizer, self.world)
        self.model_args = b.model_args(config, self.spec, tokenizer.n_words, device_type=self.device.type)
        whole = b.meta_model(self.spec, self.model_args)
        num_params = sum(p.numel() for p in whole.parameters())
        self.num_flop_params = self.spec.count_flop_params(self.model_args, whole)
        self.step_fn = self._build_step(whole, tokenizer.eos_id)
        self.model_parts = self.step_fn.model_parts
        self.optimizer = build_optimizer(self.model_parts, config.optimizer)
        self.in_backward = None  # optimizer.early_step_in_backward: hooks step each parameter during backward
        if config.optimizer.early_step_in_backward:
            self.in_backward = self.step_fn.build_optimizer_in_backward(self.optimizer, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.training)
        self.step = 0
        self.checkpointer = b.checkpointer(self)
        # A resumed run continues at checkpoint step + 1 (metrics.jsonl keeps the records up to it).
        self.step = self.start_step = self.checkpointer.load()
        if self.step > 0:
            changed = apply_optimizer_config(self.optimizer, self.lr_scheduler, config.optimizer)
            if rank == 0 and changed:
                logger.info("resume: the config's optimizer settings replace the checkpoint's: %s", "; ".join(changed))
        self.metrics = b.metrics(self)
        self.validator = b.validator(self, tokenizer) if config.validation.enabled else None
        self.signals = StopSignals()
        self.guard = b.guard(self)
        self.stop_requested = False
        if rank == 0:
            logger.info("\n%s", self._start_summary(num_params))

    def _build_step(self, whole: torch.nn.Module, eos_id: int) -> StepFunction:
        """The model parts, parallelized and materialised, and the one step function over them (build.py)."""
        meta_model = self.builders.meta_model
        return build_step_function(
            whole,
            lambda: meta_model(self.spec, self.model_args),
            self.spec,
            self.model_args,
            self.config,
            self.world,
            self.device,
            amp_dtype=self._autocast_dtype(),
            eos_id=eos_id,
            cp_positions=self.cp_positions,
        )

    def _start_summary(self, num_params: int) -> str:
        cfg, dims = self.config, self.parallel_dims
        return format_start_summary(
            model=f"{cfg.model.name} {cfg.model.flavor}",
            params=num_params,
            flop_params=self.num_flop_params,
            layout=format_layout(dims.degrees()),
            world_size=dims.world_size,
            global_batch=dims.dp_degree * cfg.training.batch_size * cfg.training.gradient_accumulation_steps,
            seq_len=cfg.training.seq_len,
            steps=cfg.training.steps,
            device=str(self.device),
            dump_folder=cfg.job.dump_folder,
        )

    def _autocast_dtype(self) -> torch.dtype | None:
        """FSDP applies mixed precision itself; without FSDP, autocast gives the same compute dtype."""
        dtype = to_dtype(self.config.training.mixed_precision_param)
        if self.parallel_dims.fsdp_enabled or dtype == torch.float32:
            return None
        return dtype

    def next_batches(self, data_iter: Iterator) -> list[Batch]:
        """One step's micro-batches (fine-tuning's with their PackedDocs), on the device, sharded for CP."""
        batches = []
        for _ in range(self.config.training.gradient_accumulation_steps):
            batches.append(self.shard_batch(*(t.to(self.device) for t in next(data_iter))))
        return batches

    def shard_batch(self, inputs: torch.Tensor, labels: torch.Tensor, packed: PackedDocs | None = None) -> Batch:
        """Under context parallel, this rank's sequence positions of the batch its dp rank reads (the
        model gets the matching positions from apply_cp's hook); block_causal: with its documents."""
        labels, docs = self.step_fn.feed.prepare(inputs, labels, packed) if self.step_fn.feed else (labels, None)
        if self.cp_positions is not None:
            inputs, labels = shard_sequence([inputs, labels], seq_dim=1, positions=self.cp_positions)
        return Batch(inputs, labels, docs)

    def _cp_positions(self) -> torch.Tensor | None:
        dims, balance = self.parallel_dims, self.config.experimental.context_parallel_load_balance
        if not dims.cp_enabled:
            return None
        positions = compute_cp_positions(self.config.training.seq_len, dims.cp, self.world.local_rank("cp"), balance)
        return positions.to(self.device)

    def train_step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step. Returns (this rank's mean loss, grad norm), unsynced.

        Where this rank does not hold the loss, its share is 0 (``StepFunction.reduce_loss`` sums it in).
        """
        loss_sum = torch.zeros((), device=self.device)
        token_weight = self.step_fn.count_tokens(batches)  # block_causal: every counted token weighs the same
        for batch in batches:
            loss = self.step_fn.forward_backward(batch, accum_steps=len(batches), token_weight=token_weight)
            if loss is not None:
                loss_sum += loss
        # in backward, every parameter already stepped (so on_nonfinite = "skip" is refused before launch)
        in_backward, max_norm = self.in_backward, self.config.training.max_norm
        grad_norm = self.step_fn.clip_grad_norm_(max_norm) if in_backward is None else in_backward.finish_step()
        verdict = self.guard.check(self.step, loss_sum, grad_norm)  # every rank: same verdict
        self.stop_requested = verdict.stop
        hooks = self.step_fn.hooks
        if verdict.skip:  # no update; the schedule still follows the step count
            if hooks is not None:
                hooks.discard_step()
        else:
            if in_backward is None:
                self.optimizer.step()
            if hooks is not None:
                hooks.after_optimizer_step(keep_metrics=self._is_log_step())
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

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
                cfg.profiling.enable_profiling,
                trace_dir=trace_dir,
                profile_freq=cfg.profiling.profile_freq,
                global_step=self.step,
                rank=self.rank,
            ) as profiler,
            maybe_enable_memory_snapshot(
                cfg.profiling.enable_memory_snapshot,
                snapshot_dir=snap_dir,
                profile_freq=cfg.profiling.profile_freq,
                device=self.device,
                global_step=self.step,
                rank=self.rank,
            ) as snapshotter,
        ):
            on_main_thread = threading.current_thread() is threading.main_thread()
            if on_main_thread:  # Python delivers signals to the main thread only
                self.signals.install()
            try:
                while self.step < cfg.training.steps:
                    self.run_step(data_iter)
                    for tool in (profiler, snapshotter):
                        if tool is not None:
                            tool.step()
            finally:
                if on_main_thread:
                    self.signals.restore()
        gc.enable()
        if self.rank == 0:
            logger.info(self.metrics.end_summary(self.step, checkpoint=self.checkpointer.summary()))

    def run_step(self, data_iter: Iterator) -> None:
        """One optimizer step: fetch the micro-batches, train on them, record metrics."""
        self.step += 1
        data_start = time.perf_counter()
        batches = self.next_batches(data_iter)
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
            extra = self.step_fn.hooks.metrics() if self.step_fn.hooks is not None else None
            self.metrics.log(self.step, loss, grad_norm, lr=self.lr_scheduler.get_last_lr()[0], extra=extra)
        v = cfg.validation
        if self.validator is not None and (self.step % v.freq == 0 or self.step == cfg.training.steps):
            self.metrics.log_validation(self.step, self.validator.run())
        self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
        if self.stop_requested and self.step < cfg.training.steps:  # at the last step the run is done anyway
            self._stop()
        if first:
            set_pg_timeout(cfg.comm.train_timeout_seconds)
        if self.step % cfg.training.gc_freq == 0:
            gc.collect(1)

    def _stop(self) -> None:
        """A stop signal reached some rank during this step: save it (if not just saved) and stop."""
        saved = self.checkpointer.save_now(self.step)
        where = "checkpointing is off (checkpoint.enable_checkpoint), nothing saved"
        if saved:
            where = f"checkpoint step-{self.step} saved; run the same command to resume"
        raise RunStopped(f"stopped by a signal after step {self.step}: {where}")

    def close(self) -> None:
        self.checkpointer.close()  # waits for an async save in flight
        self.metrics.close()


def _build_metrics(trainer: Trainer) -> StepMetrics:
    cfg = trainer.config
    return StepMetrics(
        metrics=cfg.metrics,
        training=cfg.training,
        float8=cfg.float8,
        cp_degree=trainer.parallel_dims.cp,
        dump_folder=cfg.job.dump_folder,
        wandb_config=cfg.to_dict(),
        start_step=trainer.step,
        device=trainer.device,
        enabled=trainer.rank == 0,
        reduce_loss=trainer.step_fn.reduce_loss,
        num_params=trainer.num_flop_params,
        model_args=trainer.model_args,
        documents=trainer.step_fn.feed.take_stats if trainer.step_fn.feed is not None else None,
    )


def build_checkpointer(trainer: Trainer, *, before_marker: Callable[[int], None] | None = None) -> CheckpointManager:
    """The trainer's default ``TrainerBuilders.checkpointer``; ``before_marker``: see ``CheckpointManager``."""
    cfg = trainer.config
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        model_parts=trainer.model_parts,
        optimizer=trainer.optimizer,
        lr_scheduler=trainer.lr_scheduler,
        data_loader=trainer.data_loader,
        dp_rank=trainer.world.local_rank("dp"),
        rank=trainer.rank,
        device=trainer.device,
        model_info=model_info(model=cfg.model, model_args=trainer.model_args),
        data_info={"dataset": cfg.training.dataset, "dataset_path": cfg.training.dataset_path},
        before_marker=before_marker,
    )


def _build_validator(trainer: Trainer, tokenizer) -> Validator:
    return Validator(
        tokenizer,
        validation=trainer.config.validation,
        training=trainer.config.training,
        world=trainer.world,
        step_fn=trainer.step_fn,
        shard_batch=trainer.shard_batch,
    )


def _build_guard(trainer: Trainer) -> StepGuard:
    cfg = trainer.config.training
    return StepGuard(cfg.on_nonfinite, cfg.max_nonfinite_skips, trainer.device, trainer.signals)


def _with_trainer_defaults(builders: TrainerBuilders) -> TrainerBuilders:
    defaults = dict(metrics=_build_metrics, checkpointer=build_checkpointer, validator=_build_validator)
    defaults["guard"] = _build_guard
    return dataclasses.replace(builders, **{k: v for k, v in defaults.items() if getattr(builders, k) is None})


def run_job(config: JobConfig, *, world_size: int, rank: int, builders: TrainerBuilders | None = None) -> None:
    """Validate, build, train. Joins the process group if none exists and leaves it as it is.

    A launcher that runs several jobs in one set of processes (the tests' worker pool, tests/pool.py) calls this
    once per job under one process group. ``builders``: the trainer's (default: a real training run).
    """
    for warning in run_preflight(config, world_size):
        if rank == 0:
            logger.warning(warning)
    os.makedirs(config.job.dump_folder, exist_ok=True)
    # One run per folder: rank 0 holds run.lock until exit, and a run that does not resume sets the earlier one aside.
    with RunLock(config.job.dump_folder) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            resumed = resumes_from(config.checkpoint, config.job.dump_folder)
            if resumed is None:
                set_aside_earlier_run(config.job.dump_folder, run_record_names(config))
            write_run_records(config, world_size, resumed_from=resumed)
            if config.job.print_args:
                logger.info("resolved config:\n%s", config.to_toml())
        if config.checkpoint.create_seed_checkpoint:
            create_seed_checkpoint(config)
            return
        trainer = Trainer(config, world_size=world_size, rank=rank, builders=builders)
        try:
            trainer.train()
        finally:
            trainer.close()


def run(config: JobConfig, *, world_size: int, rank: int, builders: TrainerBuilders | None = None) -> None:
    """``run_job``, then always leave the process group destroyed."""
    try:
        run_job(config, world_size=world_size, rank=rank, builders=builders)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None, *, builders: TrainerBuilders | None = None) -> int:
    """The entry point of every rank; ``builders``: see ``run_job``. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(format_help())
        return 0
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init_logger()
    watch_parent()  # under torchrun: stop when the launcher dies
    try:
        run(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank, builders=builders)
    except (RunStopped, NonFiniteStep) as e:  # every rank agreed on it: one line
        return report_failure(rank, "stopped" if isinstance(e, RunStopped) else "error", str(e), e.exit_code)
    except BaseException as e:  # DCP's CheckpointException is a BaseException; told once (launch/failures.py)
        if isinstance(e, SystemExit):
            raise
        return report_exception(e, rank, USER_ERRORS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
