"""Per-step metrics of the trainer: global loss, tokens/s, MFU, memory, timings.

Nothing here synchronises the device except ``log``: step times are averaged over the window
since the last log, so a log_freq > 1 costs one sync per window rather than one per step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchtitan.observability.console import build_palette, format_end_summary, format_step_line, format_validation_line
from torchtitan.components.load_balancing import compute_load_metrics
from torchtitan.observability.flops import get_peak_flops
from torchtitan.observability.metrics import build_device_memory_monitor, build_metric_logger, compute_mfu, compute_num_flops_per_token
from torchtitan.distributed.fsdp import to_dtype
from torchtitan.distributed.device import synchronize

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.models import ModelArgs

logger = logging.getLogger(__name__)


class StepMetrics:
    def __init__(
        self,
        config: JobConfig,
        *,
        device: torch.device,
        enabled: bool,
        loss_group: dist.ProcessGroup | None,
        pp_group: dist.ProcessGroup | None,
        num_params: int,
        model_args: ModelArgs,
        append: bool = False,
    ):
        self.device = device
        self.enabled = enabled
        self.loss_group = loss_group
        self.pp_group = pp_group
        self.flops_per_token = compute_num_flops_per_token(
            num_params, model_args.n_layers, model_args.n_heads, model_args.head_dim, config.training.seq_len
        )
        compute_dtype = to_dtype(config.training.mixed_precision_param)
        self.peak_flops = get_peak_flops(device, compute_dtype, config.metrics.device_peak_flops)
        self.memory = build_device_memory_monitor(device)
        self.logger = build_metric_logger(
            config.job.dump_folder,
            enabled=enabled,
            enable_tensorboard=config.metrics.enable_tensorboard,
            save_tb_folder=config.metrics.save_tb_folder,
            append=append,
            enable_wandb=config.metrics.enable_wandb,
            wandb_config=config.to_dict(),
        )
        self.total_steps = config.training.steps
        self.palette = build_palette(config.metrics.enable_color_printing and not config.metrics.disable_color_printing)
        self.run_start = time.perf_counter()
        self.tps_history: list[float] = []
        self.best: tuple[float, int] | None = None
        self.last_validation: float | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start = time.perf_counter()
        self.window_tokens = 0
        self.window_steps = 0
        self.window_data_time = 0.0

    def add_data_time(self, seconds: float) -> None:
        self.window_data_time += seconds

    def add_step(self, tokens: int) -> None:
        self.window_tokens += tokens
        self.window_steps += 1

    def _global_loss(self, loss: torch.Tensor) -> tuple[float, float]:
        """(mean, max) of the per-rank mean losses over the data-parallel ranks.

        Under pipeline parallel only the last stage's rank has a loss (the others hold 0): a sum over
        the pipeline group brings it to every rank, so the usual logging rank can report it.
        """
        if self.pp_group is not None:
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=self.pp_group)
        if self.loss_group is None:
            return loss.item(), loss.item()
        both = torch.stack([loss.detach().float(), loss.detach().float()])
        dist.all_reduce(both[:1], op=dist.ReduceOp.SUM, group=self.loss_group)
        dist.all_reduce(both[1:], op=dist.ReduceOp.MAX, group=self.loss_group)
        return both[0].item() / dist.get_world_size(self.loss_group), both[1].item()

    def log(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, *, lr: float,
        expert_load: dict[str, list[float]] | None = None,
    ) -> dict[str, float]:
        """One record: console line, metrics.jsonl, TensorBoard. ``expert_load``: MoE layer name ->
        the step's global tokens per expert (see expert_load.py); adds per-layer load and imbalance."""
        synchronize(self.device)
        elapsed = time.perf_counter() - self.window_start
        loss_avg, loss_max = self._global_loss(loss)
        tps = self.window_tokens / elapsed
        mem = self.memory.get_peak_stats()
        record = {
            "loss": loss_avg,
            "loss_max": loss_max,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tps": tps,
            "mfu": compute_mfu(tps, self.flops_per_token, self.peak_flops),
            "memory_gib": mem.max_active_gib,
            "step_time_s": elapsed / self.window_steps,
            "data_time_s": self.window_data_time / self.window_steps,
        }
        tb_extra = {}
        if expert_load is not None:
            moe = compute_load_metrics(expert_load)
            record.update(moe)
            tb_extra = {f"moe/{name}/imbalance": v for name, v in moe["expert_imbalance"].items()}
        self.tps_history.append(tps)
        if self.best is None or loss_avg < self.best[0]:
            self.best = (loss_avg, step)
        if self.enabled:
            eta = (self.total_steps - step) * record["step_time_s"]
            logger.info(format_step_line(step, self.total_steps, record, eta, self.palette))
            self.logger.log(step, record, tb_extra=tb_extra)
        self.memory.reset_peak_stats()
        self._reset_window()
        return record

    def log_validation(self, step: int, record: dict[str, float]) -> None:
        self.last_validation = record["validation_loss"]
        if self.enabled:
            logger.info(format_validation_line(step, self.total_steps, record, self.palette))
            self.logger.log(step, record)
        # validation time must not count as training time in the next window's tokens/s
        self._reset_window()

    def end_summary(self, steps: int, checkpoint: str) -> str:
        mean_tps = sum(self.tps_history) / len(self.tps_history) if self.tps_history else 0.0
        return format_end_summary(
            steps=steps, wall_s=time.perf_counter() - self.run_start, mean_tps=mean_tps,
            best_loss=self.best[0] if self.best else None, best_step=self.best[1] if self.best else None,
            last_validation=self.last_validation, checkpoint=checkpoint,
        )

    def close(self) -> None:
        self.logger.close()
