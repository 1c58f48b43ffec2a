"""The trainer: ``python -m torchtitan.train --job.config_file FILE [--section.key value ...]``.

Launch several processes with torchrun (see run_llama_train.sh); one process needs no launcher.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # a rank's process: its imports (torch, the trainer: ~400k objects) without the cyclic
    gc.disable()  # collector rescanning them as they load (0.7 of ~4.5 CPU-s a rank); re-enabled at the bottom

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.build import create_seed_checkpoint
from torchtitan.checkpointing.manager import resumes_from
from torchtitan.components.run_control import AgreedStop, RunStopped
from torchtitan.config.manager import JobConfig, format_help, print_help, wants_help
from torchtitan.distributed.backend.device import ProcessFlags, get_device_info, init_distributed, set_pg_timeout
from torchtitan.distributed.backend.host_malloc import tune_cpu_malloc
from torchtitan.engine.builders import Builders
from torchtitan.engine.parts import CoreParts, build_core_parts, build_training_parts
from torchtitan.engine.summary import start_summary
from torchtitan.features.documents.feed import Batch
from torchtitan.launch.failures import exit_without_finalization, report_exception, report_failure
from torchtitan.launch.parent_watch import watch_parent
from torchtitan.launch.run_folder import RunLock, checkpoint_root, run_folder, set_aside_earlier_run
from torchtitan.observability.logging import init_logger, set_log_level
from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.observability.run_records import run_record_names, write_run_records
from torchtitan.preflight import run_preflight
from torchtitan.preflight.registry import enabled_builders
from torchtitan.spec import merge_metrics

logger = logging.getLogger(__name__)

# What a user can get wrong: one line (printed by the launcher, with the ranks that raised it), exit code 2;
# so are storage errors (disk full, read-only folder). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    """This rank's mean loss (with replica groups: averaged over them), unsynced."""
    grad_norm: torch.Tensor
    committed: bool
    """Whether the step was applied; False only when the replica groups discarded it."""


class Trainer:
    """The pre-training loop: a thin driver over a run's parts (engine/parts.py), built once from the config.

    ``builders`` swaps the parts that touch the outside world (``engine.builders.Builders``); the memory
    estimator passes fakes there and runs this same build and step. Every optional feature takes part through
    a seam of ``TrainingParts`` (a null object where it is off), so the loop has no per-feature branches.
    """

    def __init__(self, config: JobConfig, *, world_size: int, rank: int, builders: Builders | None = None):
        builders = builders or Builders()
        device = get_device_info().device
        tune_cpu_malloc(config.training.cpu_malloc, device.type, torch.get_num_threads())  # before the build allocates
        if world_size > 1 and not dist.is_initialized():  # the memory estimator brings its own (fake) group
            init_distributed(get_device_info(), config.comm.init_timeout_seconds, config.comm.trace_buf_size)
        self.flags_found = ProcessFlags.read()  # the build may change them (determinism, float8 on CPU); close restores
        try:
            core = build_core_parts(config, world_size=world_size, rank=rank, device=device, builders=builders)
            self.parts = parts = build_training_parts(core, builders=self.training_builders(core, builders))
        except BaseException:
            self.flags_found.restore()
            raise
        self.core, self.config, self.rank, self.device = core, config, rank, device
        # A resumed run continues at checkpoint step + 1 (metrics.jsonl keeps the records up to it).
        self.step = self.start_step = parts.start_step
        self.stop_requested = False
        self.data_iter: Iterator | None = None
        if rank == 0:
            logger.info("\n%s", self.start_summary())

    def start_summary(self) -> str:
        """The block rank 0 logs before the first step."""
        return start_summary(self.parts)

    def training_builders(self, core: CoreParts, builders: Builders) -> Builders:
        """The builders of the training parts, given the core parts (another loop adds what its checkpoints hold)."""
        return builders

    def step_modules(self) -> list[torch.nn.Module]:
        """Modules the step runs besides ``model_parts`` (the RL loop's frozen reference): the memory estimator
        tracks them too."""
        return []

    def phase_done(self, name: str) -> None:
        """Called by a step at the end of a phase of its own (the RL step's generation); the memory estimator's
        tracker replaces it to read the phase's peak. A no-op in training."""

    # The parts tools and tests read most (the rest: ``self.core`` / ``self.parts``).
    model_parts = property(lambda self: self.core.model_parts)
    outer = property(lambda self: self.parts.outer)
    metrics = property(lambda self: self.parts.metrics)
    checkpointer = property(lambda self: self.parts.checkpointer)
    optimizer = property(lambda self: self.core.optimizer)
    step_fn = property(lambda self: self.core.step_fn)
    data_loader = property(lambda self: self.core.data_loader)
    model_args = property(lambda self: self.core.model_args)
    parallel_dims = property(lambda self: self.core.parallel_dims)
    num_flop_params = property(lambda self: self.core.num_flop_params)

    def next_batches(self, data_iter: Iterator) -> list[Batch]:
        return self.core.next_batches(data_iter)

    def train_step(self, batches: list[Batch]) -> StepResult:
        """Forward/backward every micro-batch, clip, step (with replica groups: average over them, step only if
        they commit). Where this rank does not hold the loss, its share is 0 (``StepFunction.reduce_loss``)."""
        core, parts = self.core, self.parts
        outer, step_fn, hooks = parts.outer, core.step_fn, core.hooks
        # block_causal: every counted token (of every replica group) weighs the same
        token_weight = step_fn.count_tokens(batches, outer_sum=outer.outer_sum)
        loss_sum = parts.step_pass.run(self.step, step_fn.train_micro_batches, batches, token_weight=token_weight)
        loss_sum, params = outer.reduce_gradients(step_fn.finish_gradients, loss_sum)
        max_norm = self.config.training.max_norm
        grad_norm = core.optimizer_step.grad_norm(lambda ps: step_fn.clip_grad_norm_(max_norm, ps), params)
        hooks.reduce_step(keep_metrics=self._is_log_step(), outer_sum=outer.outer_sum)
        verdict = parts.guard.check(self.step, loss_sum, grad_norm)  # every rank: same verdict
        self.stop_requested = verdict.stop
        committed = outer.commit(self.step)
        if verdict.skip or not committed:  # no update; the schedule still follows the committed step count
            hooks.discard_step()
        else:
            core.optimizer_step.apply(core.optimizer, outer)
            hooks.after_optimizer_step()
        if committed:
            core.lr_scheduler.step()
        core.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, grad_norm, committed)

    def _is_log_step(self) -> bool:
        cfg = self.config
        first = self.step == self.start_step + 1
        return first or self.step % cfg.metrics.log_freq == 0 or self.step == cfg.training.steps

    def train(self) -> None:
        cfg = self.config
        self.data_iter = iter(self.data_loader)
        gc.disable()  # collected every gc_freq steps instead, so pauses don't vary step to step
        with self._profilers() as (profiler, snapshotter):
            on_main_thread = threading.current_thread() is threading.main_thread()
            if on_main_thread:  # Python delivers signals to the main thread only
                self.parts.signals.install()
            try:
                while self.step < cfg.training.steps:
                    self.run_step()
                    for tool in (profiler, snapshotter):
                        if tool is not None:
                            tool.step()
            finally:
                if on_main_thread:
                    self.parts.signals.restore()
        gc.enable()
        self.outer.report_end(self.step)
        if self.rank == 0:
            logger.info(self.metrics.end_summary(self.step, checkpoint=self.checkpointer.summary()))

    @contextlib.contextmanager
    def _profilers(self) -> Iterator[tuple]:
        cfg, folder = self.config.profiling, self.core.run_folder
        with (
            maybe_enable_profiling(
                cfg.enable_profiling,
                trace_dir=os.path.join(folder, cfg.save_traces_folder),
                profile_freq=cfg.profile_freq,
                warmup=cfg.profiler_warmup,
                active=cfg.profiler_active,
                global_step=self.step,
                rank=self.rank,
            ) as profiler,
            maybe_enable_memory_snapshot(
                cfg.enable_memory_snapshot,
                snapshot_dir=os.path.join(folder, cfg.save_memory_snapshot_folder),
                profile_freq=cfg.profile_freq,
                device=self.device,
                global_step=self.step,
                rank=self.rank,
            ) as snapshotter,
        ):
            yield profiler, snapshotter

    def run_step(self) -> None:
        """One optimizer step: fetch the micro-batches, train on them, record metrics. With replica groups an
        attempt: the quorum picks the step (a healed group jumps to it), a discarded one is retried."""
        outer = self.outer
        attempt = outer.start_step()
        self.step = attempt.step
        if attempt.data_moved:
            self.data_iter = iter(self.data_loader)
        data_start = time.perf_counter()
        batches = self.next_batches(self.data_iter)
        self.metrics.add_data_time(time.perf_counter() - data_start)
        result = self.train_step(batches)
        if outer.finish_step(result.committed):  # rewound (a discarded step) or healed: a new position
            self.data_iter = iter(self.data_loader)
        self.step = outer.step  # the committed steps (a heal during a semi-sync synchronization moves it)
        if result.committed:
            self._after_step(result.loss, result.grad_norm)

    def step_tokens(self) -> float:
        """This rank's share of the step's tokens: TP, CP and PP ranks split the work on the same samples, so
        tokens/s and MFU are per-rank numbers that add up across the world."""
        t, dims = self.config.training, self.parallel_dims
        return t.batch_size * t.gradient_accumulation_steps * t.seq_len / (dims.tp * dims.cp * dims.pp)

    def _after_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        cfg = self.config
        self.metrics.add_step(self.step_tokens())
        first = self.step == self.start_step + 1
        if self._is_log_step():
            lr = self.core.lr_scheduler.get_last_lr()[0]
            self.metrics.log(self.step, loss, grad_norm, lr=lr, extra=self._extra())
        for work in self.parts.after_step:  # validation, evaluation: each at its own steps
            work.maybe_run(self.step)
        if self.outer.writes_checkpoints:  # of several replica groups, the lowest live one
            self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
        # at the last step the run is done anyway; semi-sync replica groups stop at a synchronization
        if self.stop_requested and self.step < cfg.training.steps and self.outer.can_stop:
            self._stop()
        if first:
            set_pg_timeout(cfg.comm.train_timeout_seconds)
        if self.step % cfg.training.gc_freq == 0:
            gc.collect(1)

    def _extra(self) -> tuple[dict, dict] | None:
        """The log record's extra fields: the family's step hooks' and the replica groups' (the live groups)."""
        t = self.config.training
        group_batch = self.parallel_dims.dp_degree * t.batch_size * t.gradient_accumulation_steps
        return merge_metrics(self.core.hooks.metrics(), self.outer.metrics(group_batch))

    def _stop(self) -> None:
        """A stop signal reached some rank during this step: save it (if not just saved) and stop."""
        self.outer.before_stop(self.step)  # a group that does not keep the checkpoint leaves here
        saved = self.checkpointer.save_now(self.step)
        where = "checkpointing is off (checkpoint.enable_checkpoint), nothing saved"
        if saved:
            where = f"checkpoint step-{self.step} saved; run the same command to resume"
        raise RunStopped(f"stopped by a signal after step {self.step}: {where}")

    def close(self) -> None:
        try:
            self.checkpointer.close()  # waits for an async save in flight
            self.metrics.close()
            self.outer.close()
        finally:
            self.flags_found.restore()


def driver(config: JobConfig, *, estimate: bool = False) -> Callable[..., Trainer]:
    """The loop over the run's parts: a feature's (RL's) if one is on, else the pre-training ``Trainer``.
    ``estimate``: the memory estimator's version of it (preflight/registry.py)."""
    drivers = enabled_builders(config, "driver", estimate=estimate)
    return drivers[0][1] if drivers else Trainer


def run_job(config: JobConfig, *, world_size: int, rank: int, builders: Builders | None = None) -> None:
    """Validate, build, train. Joins the process group if none exists and leaves it as it is.

    A launcher that runs several jobs in one set of processes (the tests' worker pool, tests/pool.py) calls this
    once per job under one process group. ``builders``: the trainer's (default: a real training run).
    """
    set_log_level(config.job.log_level)
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
        trainer = driver(config)(config, world_size=world_size, rank=rank, builders=builders)
        try:
            trainer.train()
        finally:
            trainer.close()


def run(config: JobConfig, *, world_size: int, rank: int, builders: Builders | None = None) -> None:
    """``run_job``, then always leave the process group destroyed."""
    try:
        run_job(config, world_size=world_size, rank=rank, builders=builders)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None, *, builders: Builders | None = None) -> int:
    """The entry point of every rank; ``builders``: see ``run_job``. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print_help(format_help())
        return 0
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    init_logger()
    watch_parent()  # under torchrun: stop when the launcher dies
    try:
        run(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank, builders=builders)
    except AgreedStop as e:  # every rank agreed: one line
        return report_failure(rank, "stopped" if isinstance(e, RunStopped) else "error", str(e), e.exit_code)
    except BaseException as e:  # DCP's CheckpointException is a BaseException; told once (launch/failures.py)
        if isinstance(e, SystemExit):
            raise
        return report_exception(e, rank, USER_ERRORS)
    return 0


if __name__ == "__main__":
    # torch and the trainer's modules live until exit: out of the collector's scans from here on
    gc.freeze()
    gc.enable()
    exit_without_finalization(main)
