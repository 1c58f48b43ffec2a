"""Per-step metrics of the trainer: global loss, tokens/s, MFU, memory, timings.

Nothing here synchronises the device except ``log``: step times are averaged over the window
since the last log, so a log_freq > 1 costs one sync per window rather than one per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torchtitan.distributed.backend.device import synchronize
from torchtitan.dtypes import to_dtype
from torchtitan.features.stragglers.stragglers import build_straggler_watch
from torchtitan.observability.console import (
    LOSS,
    SummaryMetric,
    build_palette,
    format_end_summary,
    format_step_line,
    format_validation_line,
    summary_metric,
)
from torchtitan.observability.flops import LinearShape, PeakFlops, get_peak_flops
from torchtitan.observability.metrics import (
    build_device_memory_monitor,
    build_metric_logger,
    compute_mfu,
    model_flops_per_token,
)
from torchtitan.observability.peak_cache import drop_entry

if TYPE_CHECKING:
    from torchtitan.config.schema import Float8, Metrics, Training
    from torchtitan.models import ModelArgs
    from torchtitan.models.common.documents import DocumentStats

logger = logging.getLogger(__name__)


class StepMetrics:
    def __init__(
        self,
        *,
        metrics: Metrics,
        training: Training,
        float8: Float8,
        cp_degree: int,
        dump_folder: str,
        device: torch.device,
        enabled: bool,
        reduce_loss: Callable[[torch.Tensor], tuple[float, float]],
        num_params: int,
        model_args: ModelArgs,
        start_step: int = 0,
        wandb_config: dict[str, Any] | None = None,
        documents: Callable[[], DocumentStats | None] | None = None,
        data_mix: Callable[[], tuple[dict[str, Any], dict[str, float]]] | None = None,
    ):
        """cp_degree: the context-parallel degree (each rank's micro-batch holds 1/cp of its tokens).
        start_step: the step a resumed run continues after (0: a new run): metrics.jsonl is appended to, and
        the end summary counts this run's steps apart.
        wandb_config: the run's resolved config, recorded by Weights & Biases (metrics.enable_wandb).
        documents (block_causal): returns the ``DocumentStats`` trained on since its last call; MFU then
        counts attention over the visible pairs only (``mfu_attention``), and each record has the
        global batch's real and trained tokens per step (``tokens_per_step``, ``trained_tokens_per_step``)."""
        self.device = device
        self.documents, self.seq_len, self.cp_degree = documents, training.seq_len, cp_degree
        self.data_mix = data_mix  # a blend: each source's samples and tokens in the step (record fields, scalars)
        self.flop_model = (num_params, model_args)
        self.enabled = enabled
        self.reduce_loss = reduce_loss  # per-rank loss -> (global mean, max): the step function's
        self.flops_per_token = model_flops_per_token(num_params, model_args, training.seq_len)
        self.peak = build_peak_flops(
            device, model_args, training=training, metrics=metrics, float8=float8, cp_degree=cp_degree
        )
        if enabled and float8.enable_float8_linear:
            logger.info("float8 run: MFU divides by the peak a run without float8 uses (%s)", self.peak.source)
        self.mfu_unreliable = False  # set once an MFU exceeds 100%: the peak is too low for every step
        self.memory = build_device_memory_monitor(device)
        self.logger = build_metric_logger(
            dump_folder,
            enabled=enabled,
            enable_tensorboard=metrics.enable_tensorboard,
            save_tb_folder=metrics.save_tb_folder,
            append=start_step > 0,
            enable_wandb=metrics.enable_wandb,
            wandb_config=wandb_config,
        )
        self.total_steps, self.start_step = training.steps, start_step
        self.palette = build_palette(metrics.enable_color_printing)
        self.run_start = time.perf_counter()
        self.tps_history: list[float] = []
        self.best: tuple[float, int, SummaryMetric] | None = None  # (value, step, what) for the end summary
        self.last_validation: float | None = None
        self.stragglers = build_straggler_watch(metrics, log=enabled)  # None unless metrics.straggler_factor
        self.document_steps = 0  # steps in the document statistics: a validation restarts the window, not them
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start = time.perf_counter()
        self.window_tokens = 0
        self.window_steps = 0
        self.window_data_time = 0.0
        self.window_wait = 0.0

    def add_data_time(self, seconds: float) -> None:
        self.window_data_time += seconds

    def add_wait(self, seconds: float) -> None:
        """Time this rank waited for the others in a step's closing all-reduce (the straggler watch's)."""
        self.window_wait += seconds

    def add_step(self, tokens: int) -> None:
        self.window_tokens += tokens
        self.window_steps += 1
        self.document_steps += 1

    def log(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        *,
        lr: float,
        extra: tuple[dict[str, Any], dict[str, float]] | None = None,
    ) -> dict[str, float | None]:
        """One record: console line, metrics.jsonl, TensorBoard. ``extra``: the model family's own
        (record fields, TensorBoard scalars) for this step, from its step hooks."""
        synchronize(self.device)
        elapsed = time.perf_counter() - self.window_start
        loss_avg, loss_max = self.reduce_loss(loss)
        tps = self.window_tokens / elapsed
        mem = self.memory.get_peak_stats()
        docs = self.documents() if self.documents is not None else None
        record = {
            "loss": loss_avg,
            "loss_max": loss_max,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tps": tps,
            "mfu": self._mfu(tps, self._flops_per_token(docs)),
            "memory_gib": mem.max_active_gib,
            "step_time_s": elapsed / self.window_steps,
            "data_time_s": self.window_data_time / self.window_steps,
        }
        if self.stragglers is not None:  # a collective: every rank logs at the same steps
            wait = self.window_wait / self.window_steps
            busy = record["step_time_s"] - wait
            record.update(self.stragglers.observe(step, busy_s=busy, data_s=record["data_time_s"], wait_s=wait))
        if docs is not None:
            # each CP rank counts its dp rank's whole windows (DocumentFeed.take_stats)
            per_step = self.cp_degree * self.document_steps
            record.update(
                documents_per_window=docs.documents / docs.windows,
                tokens_per_step=docs.tokens / per_step,
                trained_tokens_per_step=docs.trained / per_step,
                mfu_attention="visible_pairs",
            )
            if docs.patches:  # image-text data: the tower's patches (MFU counts its FLOPs too)
                record["image_patches_per_step"] = docs.patches / per_step
        tb_extra = {}
        for fields, scalars in (part for part in (extra, self.data_mix and self.data_mix()) if part is not None):
            record.update(fields)
            tb_extra.update(scalars)
        self.tps_history.append(tps)
        self._track_best(step, record)
        if self.enabled:
            eta = (self.total_steps - step) * record["step_time_s"]
            logger.info(format_step_line(step, self.total_steps, record, eta, self.palette))
            self.logger.log(step, record, tb_extra=tb_extra)
        self.memory.reset_peak_stats()
        self._reset_window()
        self.document_steps = 0
        return record

    def _track_best(self, step: int, record: dict[str, Any]) -> None:
        """The best value so far of the record field the end summary names (``summary_metric``)."""
        metric = summary_metric(record)
        value = record[metric.key]
        if self.best is None or (value > self.best[0] if metric.higher_is_better else value < self.best[0]):
            self.best = (value, step, metric)

    def _flops_per_token(self, docs: DocumentStats | None) -> float:
        if docs is None:
            return self.flops_per_token
        flops = model_flops_per_token(
            *self.flop_model, self.seq_len, attention_pairs=docs.pairs / (docs.windows * self.seq_len)
        )
        image_flops = getattr(self.flop_model[1], "image_flops", None)  # an image model: its tower's, per token
        if image_flops is not None and docs.patches:
            flops += image_flops(docs.patches, docs.patch_pairs) / (docs.windows * self.seq_len)
        return flops

    def _mfu(self, tps: float, flops_per_token: float) -> float | None:
        """MFU in %, or None (no MFU shown or written) from the first step whose MFU exceeds 100%.

        An MFU over 100% means the peak is too low, and then every step's MFU is too high, not
        only the ones past 100%: so MFU stays off for the rest of the run, with one warning. A
        cached CPU peak is then removed from the cache, so the next run measures it again (by the
        rank whose measurement the cache holds: each rank measured its own).
        """
        if self.mfu_unreliable:
            return None
        mfu = compute_mfu(tps, flops_per_token, self.peak.flops)
        if mfu <= 100.0:
            return mfu
        self.mfu_unreliable = True
        cached = self.peak.cached
        dropped = cached is not None and drop_entry(cached, self.peak.flops)
        if self.enabled:
            logger.warning(
                "MFU would be %.0f%%, above 100%%: the peak FLOPS it divides by is unreliable (%s). "
                "MFU is not reported for the rest of this run; %sset metrics.device_peak_flops to this "
                "device's peak FLOP/s for an MFU",
                mfu,
                self.peak.source,
                f"the peak is removed from {cached.path}, so the next run measures it again, or " if dropped else "",
            )
        return None

    def log_validation(self, step: int, record: dict[str, float]) -> None:
        self.last_validation = record["validation_loss"]
        if self.enabled:
            logger.info(format_validation_line(step, self.total_steps, record, self.palette))
            self.logger.log(step, record)
        # validation time must not count as training time in the next window's tokens/s
        self._reset_window()

    def log_eval(self, step: int, record: dict[str, float]) -> None:
        """Downstream task metrics (``[eval]``): one console line, metrics.jsonl and TensorBoard."""
        if self.enabled:
            shown = "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in record.items())
            logger.info("eval at step %d/%d  %s", step, self.total_steps, shown)
            self.logger.log(step, record)
        self._reset_window()  # evaluation time must not count as training time either

    def end_summary(self, steps: int, checkpoint: str) -> str:
        mean_tps = sum(self.tps_history) / len(self.tps_history) if self.tps_history else 0.0
        return format_end_summary(
            steps=steps,
            start_step=self.start_step,
            wall_s=time.perf_counter() - self.run_start,
            mean_tps=mean_tps,
            best_loss=self.best[0] if self.best else None,
            best_step=self.best[1] if self.best else None,
            best_label=self.best[2].label if self.best else LOSS.label,
            last_validation=self.last_validation,
            checkpoint=checkpoint,
        )

    def close(self) -> None:
        self.logger.close()


def build_peak_flops(
    device: torch.device, model_args: ModelArgs, *, training: Training, metrics: Metrics, float8: Float8, cp_degree: int
) -> PeakFlops:
    """The MFU denominator: the compute dtype's peak, the same with float8 on (labelled so; docs/metrics.md)."""
    tokens = training.batch_size * training.seq_len // cp_degree
    return get_peak_flops(
        device,
        to_dtype(training.mixed_precision_param),
        metrics.device_peak_flops,
        linears=build_linear_shapes(model_args, tokens),
        float8=float8.enable_float8_linear,
    )


def build_linear_shapes(model_args: ModelArgs, tokens: int) -> tuple[LinearShape, ...]:
    """The linears the CPU peak is measured on: one micro-batch's `tokens` through the model's widths.

    The attention projection (dim x dim), an FFN-wide linear (dim x 4 dim) and the output projection
    (dim x vocab), usually the largest; only fields every family's args have, so no family is named.
    """
    dim = model_args.dim
    return tuple(LinearShape(tokens, dim, width) for width in (dim, 4 * dim, model_args.vocab_size))
