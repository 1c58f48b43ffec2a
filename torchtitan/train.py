"""The trainer: ``python -m torchtitan.train --job.config_file FILE [--section.key value ...]``.

Launch several processes with torchrun (see run_llama_train.sh); one process needs no launcher.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.build import TrainerBuilders, build_data_shard, build_step_function, create_seed_checkpoint
from torchtitan.checkpointing.manager import resumes_from
from torchtitan.components.document_feed import Batch
from torchtitan.components.optimizer import apply_optimizer_config, build_lr_scheduler, build_optimizer
from torchtitan.components.run_control import NonFiniteStep, ReplayMismatch, RunStopped, StopSignals
from torchtitan.components.step import StepFunction
from torchtitan.config.manager import JobConfig, format_help, wants_help
from torchtitan.datasets.sft.packing import PackedDocs
from torchtitan.distributed.context_parallel import compute_cp_positions, shard_sequence
from torchtitan.distributed.device import get_device_info, init_distributed, set_determinism, set_pg_timeout
from torchtitan.distributed.mesh import WorldMesh
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.fault_tolerance.errors import ReplicaGroupsFailed
from torchtitan.launch.failures import exit_without_finalization, report_exception, report_failure
from torchtitan.launch.parent_watch import watch_parent
from torchtitan.launch.run_folder import RunLock, checkpoint_root, run_folder, set_aside_earlier_run
from torchtitan.observability.logging import init_logger
from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.observability.run_records import run_record_names, write_run_records
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec, merge_metrics
from torchtitan.trainer_parts import load_start_weights, start_summary, with_trainer_defaults

logger = logging.getLogger(__name__)

# What a user can get wrong: one line (printed by the launcher, with the ranks that raised it), exit code 2;
# so are storage errors (disk full, read-only folder). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    """This rank's mean loss (fault tolerance: averaged over the replica groups), unsynced."""
    grad_norm: torch.Tensor
    committed: bool
    """Whether the step was applied; False only under fault tolerance (the replica groups discarded it)."""


class Trainer:
    """Builds everything once from the config, then ``train()`` runs the loop.

    ``builders`` swaps the parts that touch the outside world (see ``build.TrainerBuilders``); the
    memory estimator passes fakes there and runs this same build and step.
    """

    def __init__(self, config: JobConfig, *, world_size: int, rank: int, builders: TrainerBuilders | None = None):
        self.config, self.rank = config, rank
        self.builders = b = with_trainer_defaults(builders or TrainerBuilders())
        self.device = get_device_info().device
        if world_size > 1 and not dist.is_initialized():  # the memory estimator brings its own (fake) group
            init_distributed(get_device_info(), config.comm.init_timeout_seconds, config.comm.trace_buf_size)
        self.spec = get_model_spec(config.model.name)
        self.parallel_dims = ParallelDims.from_sections(
            training=config.training, experimental=config.experimental, world_size=world_size
        )
        self.world = WorldMesh(self.parallel_dims, b.mesh(self.parallel_dims, self.device.type))
        self.run_folder = run_folder(config)
        self.cp_positions = self._cp_positions()
        set_determinism(config.training.seed, config.training.deterministic)
        tokenizer = b.tokenizer(config.model)
        self.shard = build_data_shard(self.world, config.fault_tolerance)
        self.data_loader = b.data_loader(config.training, tokenizer, self.shard)
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
        # fault tolerance: the quorum, averaging and commit across replica groups (fault_tolerance/replicas.py)
        self.replicas = b.replicas(self) if config.fault_tolerance.enable else None
        self.checkpointer = b.checkpointer(self)
        # A resumed run continues at checkpoint step + 1 (metrics.jsonl keeps the records up to it).
        self.step = self.start_step = load_start_weights(self)
        if self.step > 0:
            changed = apply_optimizer_config(self.optimizer, self.lr_scheduler, config.optimizer, self.model_parts)
            if rank == 0 and changed:
                logger.info("resume: the config's optimizer settings replace the checkpoint's: %s", "; ".join(changed))
        if self.replicas is not None:
            self.replicas.resume_at(self.step)
        self.metrics = b.metrics(self)
        self.validator = b.validator(self, tokenizer) if config.validation.enabled else None
        self.evaluator = b.evaluator(self) if config.eval.enabled else None  # lm-eval tasks ([eval], torchtitan/eval)
        self.signals = StopSignals()
        self.guard = b.guard(self)
        self.replay = b.replay(self)  # training.replay_every_n_steps: the SDC check (components/replay.py)
        self.stop_requested = False
        self.data_iter: Iterator | None = None
        if rank == 0:
            logger.info("\n%s", start_summary(self, num_params))

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
            eos_id=eos_id,
            cp_positions=self.cp_positions,
        )

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

    def train_step(self, batches: list[Batch]) -> StepResult:
        """Forward/backward every micro-batch, clip, step (under fault tolerance: average over the replica
        groups, step only if they commit). Where this rank does not hold the loss, its share is 0
        (``StepFunction.reduce_loss`` sums it in)."""
        replicas = self.replicas
        replica_sum = replicas.replica_sum if replicas is not None else None
        # block_causal: every counted token (of every replica group) weighs the same
        token_weight = self.step_fn.count_tokens(batches, replica_sum=replica_sum)
        loss_sum = self.replay.run(self.step, self.step_fn.train_micro_batches, batches, token_weight=token_weight)
        params = None
        if replicas is not None:  # the gradients and loss of every live group, then clipped like HSDP's
            params = self.step_fn.finish_gradients()
            loss_sum = replicas.average(params, loss_sum)
        # in backward, every parameter already stepped (so on_nonfinite = "skip" is refused before launch)
        in_backward, max_norm = self.in_backward, self.config.training.max_norm
        grad_norm = self.step_fn.clip_grad_norm_(max_norm, params) if in_backward is None else in_backward.finish_step()
        hooks = self.step_fn.hooks
        if hooks is not None:
            hooks.reduce_step(keep_metrics=self._is_log_step(), replica_sum=replica_sum)
        verdict = self.guard.check(self.step, loss_sum, grad_norm)  # every rank: same verdict
        self.stop_requested = verdict.stop
        committed = replicas.commit(self.step) if replicas is not None else True
        if verdict.skip or not committed:  # no update; the schedule still follows the committed step count
            if hooks is not None:
                hooks.discard_step()
        else:
            if in_backward is None and replicas is not None:
                replicas.step_optimizer(self.optimizer)  # semi-sync fault tolerance may synchronize inside it
            elif in_backward is None:
                self.optimizer.step()
            if hooks is not None:
                hooks.after_optimizer_step()
        if committed:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, grad_norm, committed)

    def _is_log_step(self) -> bool:
        cfg = self.config
        first = self.step == self.start_step + 1
        return first or self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps

    def train(self) -> None:
        cfg = self.config
        self.data_iter = iter(self.data_loader)
        gc.disable()  # collected every gc_freq steps instead, so pauses don't vary step to step
        trace_dir = os.path.join(self.run_folder, cfg.profiling.save_traces_folder)
        snap_dir = os.path.join(self.run_folder, cfg.profiling.save_memory_snapshot_folder)
        with (
            maybe_enable_profiling(
                cfg.profiling.enable_profiling,
                trace_dir=trace_dir,
                profile_freq=cfg.profiling.profile_freq,
                warmup=cfg.profiling.profiler_warmup,
                active=cfg.profiling.profiler_active,
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
                    self.run_step()
                    for tool in (profiler, snapshotter):
                        if tool is not None:
                            tool.step()
            finally:
                if on_main_thread:
                    self.signals.restore()
        gc.enable()
        if self.replicas is not None:
            self.replicas.report_end(self.step)
        if self.rank == 0:
            logger.info(self.metrics.end_summary(self.step, checkpoint=self.checkpointer.summary()))

    def run_step(self) -> None:
        """One optimizer step: fetch the micro-batches, train on them, record metrics. Under fault tolerance
        an attempt: the quorum picks the step (a healed group jumps to it), a discarded one is retried."""
        replicas = self.replicas
        if replicas is None:
            self.step += 1
        else:
            attempt = replicas.start_step()
            self.step = attempt.step
            if attempt.data_moved:
                self.data_iter = iter(self.data_loader)
        data_start = time.perf_counter()
        batches = self.next_batches(self.data_iter)
        self.metrics.add_data_time(time.perf_counter() - data_start)
        result = self.train_step(batches)
        if replicas is not None:
            if replicas.finish_step(result.committed):  # rewound (a discarded step) or healed: a new position
                self.data_iter = iter(self.data_loader)
            self.step = replicas.step  # the committed steps (a heal during a semi-sync synchronization moves it)
        if result.committed:
            self._after_step(result.loss, result.grad_norm)

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
            self.metrics.log(self.step, loss, grad_norm, lr=self.lr_scheduler.get_last_lr()[0], extra=self._extra())
        v = cfg.validation
        if self.validator is not None and (self.step % v.freq == 0 or self.step == cfg.training.steps):
            self.metrics.log_validation(self.step, self.validator.run())
        if self.evaluator is not None:
            self.evaluator.maybe_run(self.step)
        if self.replicas is None or self.replicas.writes_checkpoints:  # fault tolerance: the lowest live group
            self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
        # at the last step the run is done anyway; semi-sync fault tolerance stops at a synchronization
        if self.stop_requested and self.step < cfg.training.steps and (self.replicas is None or self.replicas.can_stop):
            self._stop()
        if first:
            set_pg_timeout(cfg.comm.train_timeout_seconds)
        if self.step % cfg.training.gc_freq == 0:
            gc.collect(1)

    def _extra(self) -> tuple[dict, dict] | None:
        """The log record's extra fields: the family's step hooks' and fault tolerance's (the live groups)."""
        hooks, replicas = self.step_fn.hooks, self.replicas
        t = self.config.training
        group_batch = self.parallel_dims.dp_degree * t.batch_size * t.gradient_accumulation_steps
        return merge_metrics(hooks and hooks.metrics(), replicas and replicas.metrics(group_batch))

    def _stop(self) -> None:
        """A stop signal reached some rank during this step: save it (if not just saved) and stop."""
        if self.replicas is not None and not self.replicas.writes_checkpoints:
            raise RunStopped(
                f"stopped by a signal after step {self.step}: replica group {self.replicas.members[0]} (the lowest "
                "live one) keeps the shared checkpoint; this group leaves the quorum, the others go on"
            )
        saved = self.checkpointer.save_now(self.step)
        where = "checkpointing is off (checkpoint.enable_checkpoint), nothing saved"
        if saved:
            where = f"checkpoint step-{self.step} saved; run the same command to resume"
        raise RunStopped(f"stopped by a signal after step {self.step}: {where}")

    def close(self) -> None:
        self.checkpointer.close()  # waits for an async save in flight
        self.metrics.close()
        if self.replicas is not None:
            self.replicas.close()


def run_job(config: JobConfig, *, world_size: int, rank: int, builders: TrainerBuilders | None = None) -> None:
    """Validate, build, train. Joins the process group if none exists and leaves it as it is.

    A launcher that runs several jobs in one set of processes (the tests' worker pool, tests/pool.py) calls this
    once per job under one process group. ``builders``: the trainer's (default: a real training run).
    """
    for warning in run_preflight(config, world_size):
        if rank == 0:
            logger.warning(warning)
    folder = run_folder(config)  # fault tolerance: the replica group's own folder (checkpoints stay shared)
    os.makedirs(folder, exist_ok=True)
    # One run per folder: rank 0 holds run.lock until exit, and a run that does not resume sets the earlier one aside.
    with RunLock(folder) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            resumed = resumes_from(config.checkpoint, checkpoint_root(config))
            if resumed is None:
                set_aside_earlier_run(folder, run_record_names(config))
            write_run_records(config, world_size, resumed_from=resumed, folder=folder)
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
    except (RunStopped, NonFiniteStep, ReplayMismatch, ReplicaGroupsFailed) as e:  # every rank agreed: one line
        return report_failure(rank, "stopped" if isinstance(e, RunStopped) else "error", str(e), e.exit_code)
    except BaseException as e:  # DCP's CheckpointException is a BaseException; told once (launch/failures.py)
        if isinstance(e, SystemExit):
            raise
        return report_exception(e, rank, USER_ERRORS)
    return 0


if __name__ == "__main__":
    exit_without_finalization(main)
