"""What a person reads on the console: the step line and the start/end summaries.

Colour only when the log stream is a terminal and colour printing is on; redirected output
(files, CI logs, `tee`) is plain text with no escape codes.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torchtitan.config.schema import Training


@dataclass(frozen=True)
class Palette:
    step: str = ""
    loss: str = ""
    value: str = ""
    dim: str = ""
    reset: str = ""


PLAIN = Palette()
COLOURS = Palette(step="\033[36m", loss="\033[1;32m", value="\033[33m", dim="\033[2m", reset="\033[0m")


def build_palette(enabled: bool, stream=None) -> Palette:
    stream = sys.stderr if stream is None else stream
    is_tty = hasattr(stream, "isatty") and stream.isatty()
    return COLOURS if enabled and is_tty else PLAIN


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def format_step_line(step: int, total: int, record: dict[str, float | None], eta_s: float, c: Palette = PLAIN) -> str:
    """One aligned line per logged step: step/total, loss, grad norm, lr, tokens/s, MFU, memory, ETA."""
    width = len(str(total))
    # None: the peak FLOPS was found unreliable (StepMetrics warns once why); "n/a" keeps the columns.
    mfu = "   n/a" if record["mfu"] is None else f"{record['mfu']:5.2f}%"
    return (
        f"{c.step}step {step:>{width}}/{total}{c.reset}  "
        f"loss {c.loss}{record['loss']:8.4f}{c.reset}  "
        f"grad_norm {c.value}{record['grad_norm']:7.4f}{c.reset}  "
        f"lr {c.value}{record['lr']:.2e}{c.reset}  "
        f"tps {c.value}{record['tps']:>9,.0f}{c.reset}  "
        # block_causal: attention FLOPs of the visible pairs only (not the causal convention's full matrix)
        + ("mfu(visible) " if record.get("mfu_attention") == "visible_pairs" else "mfu ")
        + f"{c.value}{mfu}{c.reset}  "
        f"memory {c.value}{record['memory_gib']:6.2f} GiB{c.reset}  "
        # block_causal: the global batch's trained (label not ignored) / real (not padding) tokens per step
        + (
            f"trained {c.value}{record['trained_tokens_per_step']:,.0f}/{record['tokens_per_step']:,.0f}{c.reset}  "
            if "trained_tokens_per_step" in record
            else ""
        )
        # multi-token prediction: each depth's loss (model.mtp_layers)
        + (
            f"mtp_loss {c.value}{' '.join(f'{v:.4f}' for v in record['mtp_loss'])}{c.reset}  "
            if "mtp_loss" in record
            else ""
        )
        # DeepSeek-V3.2: the indexers' loss term (added to the loss; not in ``loss``)
        + (f"indexer_loss {c.value}{record['indexer_loss']:.4f}{c.reset}  " if "indexer_loss" in record else "")
        # MoE: the worst layer's max/mean tokens per expert (per layer: metrics.jsonl)
        + (
            f"moe_imbalance {c.value}{record['expert_imbalance_max']:4.2f}{c.reset}  "
            if "expert_imbalance_max" in record
            else ""
        )
        + f"{c.dim}eta {format_duration(eta_s)}{c.reset}"
    )


def format_validation_line(step: int, total: int, record: dict[str, float], c: Palette = PLAIN) -> str:
    width = len(str(total))
    return (
        f"{c.step}validation at step {step:>{width}}/{total}{c.reset}  "
        f"loss {c.loss}{record['validation_loss']:8.4f}{c.reset}  "
        f"perplexity {c.value}{record['validation_perplexity']:10.3f}{c.reset}"
        + (f"  over {int(record['validation_tokens']):,} tokens" if "validation_tokens" in record else "")
    )


def format_layout(degrees: dict[str, int]) -> str:
    """'dp_shard 2 x tp 2' for the axes with a degree > 1; 'single process' when none."""
    parts = [f"{name} {d}" for name, d in degrees.items() if d > 1]
    return " x ".join(parts) if parts else "single process"


def format_data_source(training: Training, *, indexed: bool) -> str:
    """What the run trains on, named by its kind: 'chat: sft_arith', 'text: pydocs', 'indexed: PREFIX', 'blend of 2:
    ...' (``indexed``: ``training.dataset_path`` names an indexed dataset, read window by window)."""
    if training.dataset_mix is not None:  # a blend: its sources and weights, as given (normalised in run_info.json)
        return f"blend of {len(training.dataset_mix)}: {', '.join(training.dataset_mix)}"
    kind = {"text": "text", "chat": "chat", "prompt_completion": "prompt/completion"}[training.dataset_format]
    if kind == "text" and indexed:
        kind = "indexed"
    return f"{kind}: {training.dataset_path or training.dataset}"


def format_start_summary(
    *,
    model: str,
    params: int,
    flop_params: int,
    layout: str,
    world_size: int,
    global_batch: int,
    training: Training,
    data: str,
    start: str,
    trains: list[str],
    device: str,
    dump_folder: str,
    lines: Mapping[str, str] | None = None,
) -> str:
    """The block rank 0 logs before the first step. ``data``: ``format_data_source``'s; ``start``: where the weights
    come from; ``trains``: a line per feature that trains part of the model (e.g. adapters), none for a full run;
    ``lines``: lines by key (``batch``, ``data``, ...) that replace the block's own, and new keys added at its end (a
    step that is not pre-training's says what it does)."""
    seq_len, steps = training.seq_len, training.steps
    tokens = global_batch * seq_len
    block = [
        # flop_params: what each token is multiplied by: no embedding lookup, and only the active experts
        ("model", f"{model}: {params:,} parameters, {flop_params:,} of them multiply each token (MFU's N)"),
        *(("trains", line) for line in trains),
        ("layout", f"{layout} ({world_size} process{'es' if world_size > 1 else ''}, device {device})"),
        ("batch", f"{global_batch} samples x {seq_len} tokens = {tokens:,} tokens per step, {steps} steps"),
        ("data", data),
        ("start", start),
        ("outputs", f"{dump_folder} (metrics.jsonl, config.toml, command.txt, run_info.json)"),
    ]
    lines = dict(lines or {})
    block = [(key, lines.pop(key, text)) for key, text in block] + list(lines.items())
    return "\n".join(f"{key:<12}{text}" for key, text in block)


@dataclass(frozen=True)
class SummaryMetric:
    """A record field the end summary names at its best value."""

    key: str
    label: str
    higher_is_better: bool


LOSS = SummaryMetric("loss", "best logged loss", higher_is_better=False)
# The first of these a step's record holds is the one the end summary names. An RL record holds a loss too: the policy
# loss, ~0 by construction (the advantages' mean), whose lowest value says nothing; its reward is what the run raises.
SUMMARY_METRICS = (SummaryMetric("reward_mean", "best reward", higher_is_better=True), LOSS)


def summary_metric(record: dict[str, Any]) -> SummaryMetric:
    return next(m for m in SUMMARY_METRICS if m.key in record)


def format_end_summary(
    *,
    steps: int,
    start_step: int = 0,
    wall_s: float,
    mean_tps: float,
    best_loss: float | None,
    best_step: int | None,
    last_validation: float | None,
    checkpoint: str,
    best_label: str = LOSS.label,
) -> str:
    """``steps``: the run's last step; ``start_step``: the step a resumed run continued after (its time, tokens/s
    and best value are this run's); ``best_loss`` / ``best_step``: the best value of the record field ``best_label``
    names (``SUMMARY_METRICS``: the loss, or an RL run's reward) and its step."""
    best = "n/a" if best_loss is None else f"{best_loss:.4f} (step {best_step})"
    val = "" if last_validation is None else f", last validation loss {last_validation:.4f}"
    done = f"{steps} steps"
    if start_step:
        done += f" ({steps - start_step} this run, resumed after step {start_step})"
    return (
        f"done: {done} in {format_duration(wall_s)}, mean {mean_tps:,.0f} tokens/s per rank, "
        f"{best_label} {best}{val}; checkpoint: {checkpoint}"
    )
