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
from collections.abc import Iterator

import torch
import torch.distributed as dist

from torchtitan.build import create_seed_checkpoint
from torchtitan.checkpointing.manager import resumes_from
from torchtitan.components.batch import Batch
from torchtitan.components.run_control import AgreedStop, RunStopped
from torchtitan.components.seams import StepResult
from torchtitan.components.train_step import is_log_step
from torchtitan.config.manager import JobConfig, format_help, print_help, wants_help
from torchtitan.distributed.backend.device import ProcessFlags, get_device_info, init_distributed, set_pg_timeout
from torchtitan.distributed.backend.host_malloc import tune_cpu_malloc
from torchtitan.engine.builders import Builders
from torchtitan.engine.parts import build_core_parts, build_training_parts
from torchtitan.engine.summary import start_summary
from torchtitan.launch.failures import exit_without_finalization, report_exception, report_failure
from torchtitan.launch.parent_watch import watch_parent
from torchtitan.launch.run_folder import RunLock, checkpoint_root, run_folder, set_aside_earlier_run
from torchtitan.observability.logging import init_logger, set_log_level
from torchtitan.observability.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.observability.run_records import run_record_names, write_run_records
from torchtitan.preflight import run_preflight
from torchtitan.spec import merge_metrics

logger = logging.getLogger(__name__)

# What a user can get wrong: one line (printed by the launcher, with the ranks that raised it), exit code 2;
# so are storage errors (disk full, read-only folder). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)


class Trainer:
    """The training loop: a thin driver over a run's parts (engine/parts.py), built once from the config.

    ``builders`` swaps the parts that touch the outside world (``engine.builders.Builders``); the memory
    estimator passes fakes there and runs this same build and step. What one step does is the parts' ``runner``
    (pre-training's ``PretrainStep``, or a feature's: RL's); every optional feature takes part through a seam of
    ``TrainingParts`` (a null object where it is off), so the loop has no per-feature branches.
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
            self.parts = parts = build_training_parts(core, builders=builders)
        except BaseException:
            self.flags_found.restore()
            raise
        self.core, self.config, self.rank, self.device = core, config, rank, device
        # A resumed run continues at checkpoint step + 1 (metrics.jsonl keeps the records up to it).
        self.step = self.start_step = parts.start_step
        self.stop_requested = False
        self.data_iter: Iterator | None = None
        if rank == 0:
            logger.info("\n%s", start_summary(parts))

    # The parts tools and tests read most (the rest: ``self.core`` / ``self.parts``).
    model_parts = property(lambda self: self.core.model_parts)
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
        """The runner's training on one step's data, at the current step."""
        return self.parts.runner.train(self.step, batches)

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
        self.parts.agreement.report_end(self.step)
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
        """One step: the agreement's attempt (with replica groups the quorum picks the step; a healed group jumps to
        it), the runner's data and training on it, the commit's aftermath, then the records of a committed step."""
        agreement, runner = self.parts.agreement, self.parts.runner
        attempt = agreement.start_step()
        self.step = attempt.step
        if attempt.data_moved:
            self.data_iter = iter(self.data_loader)
        data_start = time.perf_counter()
        data = runner.data(self.step, self.data_iter)
        self.metrics.add_data_time(time.perf_counter() - data_start)
        result = runner.train(self.step, data)
        self.stop_requested = result.stop
        if agreement.finish_step(result.committed):  # rewound (a discarded step) or healed: a new position
            self.data_iter = iter(self.data_loader)
        self.step = agreement.step  # the committed steps (a heal during a semi-sync synchronization moves it)
        if result.committed:
            self._after_step(result.loss, result.grad_norm)

    def _after_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        cfg, parts = self.config, self.parts
        self.metrics.add_step(parts.runner.step_tokens())
        first = self.step == self.start_step + 1
        logged = is_log_step(cfg, self.step, self.start_step)
        if logged:
            lr = self.core.lr_scheduler.get_last_lr()[0]
            self.metrics.log(self.step, loss, grad_norm, lr=lr, extra=self._extra())
        for work in parts.after_step:  # validation, evaluation: each at its own steps
            work.maybe_run(self.step)
        if parts.share.writes_checkpoints:  # of several replica groups, the lowest live one
            self.checkpointer.maybe_save(self.step, last=self.step == cfg.training.steps)
        # at the last step the run is done anyway; semi-sync replica groups stop at a synchronization
        if self.stop_requested and self.step < cfg.training.steps and parts.stops.can_stop:
            self._stop()
        if first:
            set_pg_timeout(cfg.comm.train_timeout_seconds)
        if self.step % cfg.training.gc_freq == 0:
            gc.collect(1)
        parts.runner.after_commit(self.step, logged=logged)

    def _extra(self) -> tuple[dict, dict] | None:
        """The log record's extra fields: the family's step hooks', the replica groups' (the live groups) and the
        runner's."""
        t = self.config.training
        group_batch = self.parallel_dims.dp_degree * t.batch_size * t.gradient_accumulation_steps
        parts = self.parts
        return merge_metrics(self.core.hooks.metrics(), parts.fields.metrics(group_batch), parts.runner.metrics())

    def _stop(self) -> None:
        """A stop signal reached some rank during this step: save it (if not just saved) and stop."""
        self.parts.stops.before_stop(self.step)  # a group that does not keep the checkpoint leaves here
        saved = self.checkpointer.save_now(self.step)
        where = "checkpointing is off (checkpoint.enable_checkpoint), nothing saved"
        if saved:
            where = f"checkpoint step-{self.step} saved; run the same command to resume"
        raise RunStopped(f"stopped by a signal after step {self.step}: {where}")

    def close(self) -> None:
        try:
            self.parts.runner.close()  # RL's asynchronous generator
            self.checkpointer.close()  # waits for an async save in flight
            self.metrics.close()
            self.parts.agreement.close()
        finally:
            self.flags_found.restore()


def run_job(config: JobConfig, *, world_size: int, rank: int, builders: Builders | None = None) -> None:
    """Validate, build, train. Joins the process group if none exists and leaves it as it is.

    A launcher that runs several jobs in one set of processes (the tests' worker pool, tests/support/pool.py) calls this
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
        trainer = Trainer(config, world_size=world_size, rank=rank, builders=builders)
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
