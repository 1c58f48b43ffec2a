"""The trainer on synthetic tokens, for bench/gpu_check: build one run, time its steps, measure it, free it.

Every run is ``torchtitan.train.Trainer`` built through its public ``Builders`` seam (engine/builders.py), as the memory
estimator builds it: model, parallelisms, optimizer, compile, float8 and the step are the trainer's own. Only
the outside world is swapped: the tokenizer is its vocabulary size (``resolve_vocab``, as the estimator reads
it: the tokenizer file if it exists, else the flavor's), the data are seeded random tokens (so ``datasets`` and
``torchdata`` need not be installed; an image family: the memory estimator's random image batches,
estimation/images.py), and no metrics or checkpoint files are written. Two kinds of row keep more of the
real run: an RL row (``rl.enable``) reads its tokenizer and prompts as the trainer does, and a row with
``checkpoint.enable_checkpoint`` saves through the trainer's checkpointer (into its run's folder, removed after).
One process, world size 1: the trainer builds no mesh and applies no FSDP there (``ParallelDims.fsdp_enabled``
needs dp_shard > 1); bf16 is autocast over fp32 weights, as in any one-device run of ours.
"""

from __future__ import annotations

import gc
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu_check.breakdown import profile_steps
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.backend.device import synchronize
from torchtitan.engine.builders import Builders
from torchtitan.estimation.fake_trainer import FlavorVocabTokenizer, resolve_vocab
from torchtitan.estimation.images import RandomImageBatches
from torchtitan.observability.metrics import compute_mfu, compute_num_flops_per_token
from torchtitan.observability.step_metrics import build_peak_flops
from torchtitan.preflight import run_preflight
from torchtitan.train import Trainer

GIB = 2**30
# The debug tokenizer shipped in the repo (2,048 words): the debug flavors train with it.
SHIPPED_TOKENIZER = "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"
# No such file: resolve_vocab then takes the flavor's vocabulary (Llama 3's 128,256 for 1B and 3B).
FLAVOR_VOCAB = "no-tokenizer-file:use-the-flavor-vocabulary"
# Rates the trainer logs per step (an RL step's generation and update), kept as their median over the timed steps.
LOGGED_RATES = ("generation_tps", "update_tps")


@dataclass(frozen=True)
class RunSpec:
    """One training run: the config keys it sets, its steps and its expected cost."""

    name: str
    flavor: str
    seq_len: int
    batch_size: int
    model: str = "llama3"
    dtype: str = "bfloat16"  # training.mixed_precision_param
    compile: bool = False
    ac: str = "none"  # activation_checkpoint.mode
    mask: str = "causal"  # model.attn_mask_type
    attention_backend: str = "auto"
    float8_recipe: str | None = None
    doc_len: tuple[int, int] | None = None  # documents of lengths uniform in [lo, hi], each ended by EOS
    tokenizer: str = SHIPPED_TOKENIZER
    warmup: int = 2
    steps: int = 5
    cost_s: float = 30.0  # expected seconds on the target device, for the time budget
    extra: tuple[str, ...] = ()  # more trainer flags (the features section: Muon, step replay, ...)
    n_layers: int | None = None  # build the flavor with this many blocks (the 8B-width rows); None: the flavor's

    def flags(self, dump_folder: Path) -> list[str]:
        """The run's config as trainer flags (everything else: the schema's defaults)."""
        flags = [
            *("--job.dump_folder", str(dump_folder), "--model.name", self.model, "--model.flavor", self.flavor),
            *("--model.tokenizer_path", self.tokenizer, "--model.attn_mask_type", self.mask),
            *("--model.attention_backend", self.attention_backend, "--training.seq_len", str(self.seq_len)),
            *("--training.batch_size", str(self.batch_size), "--training.steps", str(self.warmup + self.steps)),
            *("--training.mixed_precision_param", self.dtype, "--training.compile", str(self.compile).lower()),
            *("--training.seed", "0", "--activation_checkpoint.mode", self.ac, "--metrics.log_freq", "1"),
            # the full learning rate from step 2 (the default warms up over 200): the steps really train
            *("--training.warmup_steps", "1"),
        ]
        if self.float8_recipe is not None:
            flags += ["--float8.enable_float8_linear", "true", "--float8.recipe_name", self.float8_recipe]
        return flags + list(self.extra)

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in _NOT_DESCRIBED}


_NOT_DESCRIBED = ("cost_s", "tokenizer")  # the budget's guess; the tokenizer is recorded as the vocab it gives
# What a golden row's figures depend on (bench/gpu_check/golden.py): the spec as the run's record holds it (the
# name is the golden row's key), and the vocabulary the run resolved.
SPEC_KEYS = (*(f.name for f in fields(RunSpec) if f.name not in (*_NOT_DESCRIBED, "name")), "vocab")


def build_config(spec: RunSpec, dump_folder: Path, *, device_type: str | None = None) -> JobConfig:
    """The run's JobConfig, checked as the estimator checks one (no file checks: there is no data), and for
    ``device_type``'s device where given (its one-line refusals: CUDA graphs off CUDA)."""
    config = JobConfig.parse_args(spec.flags(dump_folder), world_size=1)
    run_preflight(config, 1, this_machine=False, device_type=device_type)
    return config


def run_folder(spec: RunSpec, dump_folder: Path) -> Path:
    """The run's own folder under ``dump_folder`` (a checkpoint or an RL run writes there), from its name."""
    return dump_folder / re.sub(r"[^a-z0-9]+", "_", spec.name.lower()).strip("_")


class SyntheticTokens:
    """Endless (inputs, labels) batches of seeded random tokens, on the CPU (the trainer moves them).

    Every ``iter()`` starts the same sequence. ``doc_len``: EOS ends documents of lengths uniform in
    [lo, hi] (block_causal's boundaries); otherwise no token is EOS.
    """

    def __init__(self, batch_size: int, seq_len: int, eos_id: int, doc_len: tuple[int, int] | None, seed: int = 0):
        self.shape, self.eos_id, self.doc_len, self.seed = (batch_size, seq_len + 1), eos_id, doc_len, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            tokens = torch.randint(0, self.eos_id, self.shape, generator=g)  # (bs, seqlen + 1), no EOS
            if self.doc_len is not None:
                lo, hi = self.doc_len
                for row in tokens:
                    end = int(torch.randint(lo, hi + 1, (), generator=g))
                    while end <= row.numel():
                        row[end - 1] = self.eos_id
                        end += int(torch.randint(lo, hi + 1, (), generator=g))
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:  # a checkpointing row saves the data position: there is none to keep
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LossLog:
    """The trainer's metrics stand-in: keeps every step's loss on the device (no sync) and the record fields the
    step adds (an RL step's rates), writes no file."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.fields: list[dict[str, Any]] = []

    def add_data_time(self, seconds: float) -> None:
        pass

    def add_step(self, tokens: float) -> None:
        pass

    def log(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, *, lr: float, extra: Any = None) -> None:
        self.losses.append(loss.detach())
        self.fields.append(dict(extra[0]) if extra else {})

    def close(self) -> None:
        pass


class NoCheckpoint:
    """Checkpointing is off: the run starts at step 0 and saves nothing."""

    def load(self) -> int:
        return 0

    def maybe_save(self, step: int, *, last: bool = False) -> None:
        pass

    def save_now(self, step: int) -> bool:
        return False

    def summary(self) -> str:
        return "checkpointing off"

    def close(self) -> None:
        pass


def build_trainer(config: JobConfig, spec: RunSpec, vocab: int) -> Trainer:
    """The trainer of ``spec`` on synthetic data (an RL row: its own prompts; a checkpointing row: its checkpointer)."""
    defaults = Builders()

    def model_args(config, model_spec, vocab_size, *, device_type=None):  # the flavor, at spec.n_layers blocks
        args = defaults.model_args(config, model_spec, vocab_size, device_type=device_type)
        return args if spec.n_layers is None else replace(args, n_layers=spec.n_layers)

    def data(training, tok, shard, args=None):  # RL's prompts come from its own slot, not from here
        if getattr(args, "vision", None) is not None:  # an image family: windows of images and text
            return RandomImageBatches(training.batch_size, training.seq_len, tok.n_words, args, None)
        return SyntheticTokens(training.batch_size, training.seq_len, tok.eos_id, spec.doc_len)

    swapped: dict[str, Any] = {}
    if not config.rl.enable:  # the prompts are text: the tokenizer is read
        tokenizer = FlavorVocabTokenizer(vocab)
        swapped["tokenizer"] = lambda model: tokenizer
    if not config.checkpoint.enable_checkpoint:
        swapped["checkpointer"] = lambda core, share, modules: NoCheckpoint()
    builders = Builders(
        model_args=model_args, data_loader=data, metrics=lambda core, gradients, *, start_step: LossLog(), **swapped
    )
    return Trainer(config, world_size=1, rank=0, builders=builders)


def device_memory_allocated(device: torch.device, *, peak: bool) -> int | None:
    """The caching allocator's (peak) allocated bytes on an accelerator; None on CPU (no allocator stats)."""
    if device.type == "cpu":
        return None
    return torch.accelerator.max_memory_allocated(device) if peak else torch.accelerator.memory_allocated(device)


def free_device_memory(device: torch.device) -> None:
    """Release what the last run left: compiled graphs, garbage, the allocator's cache and its peak."""
    # dynamo's caches reference what they compiled (training.compile's blocks, FlexAttention's kernels with
    # their model's block masks); each run builds its own model, so nothing is lost
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cpu":
        torch.accelerator.empty_cache()
        torch.accelerator.reset_peak_memory_stats(device)


def run(
    spec: RunSpec,
    device: torch.device,
    dump_folder: Path,
    *,
    before_training: Callable[[Trainer], None] | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Build ``spec``'s trainer, train ``warmup`` + ``steps`` steps, and measure; the trainer is freed after.

    ``before_training``: called with the built trainer (e.g. to save or load its initial weights). ``profile``: then
    a few more steps under the profiler, and where their time went (``breakdown``). The process flags a run
    changes (deterministic kernels, oneDNN) are back as they were after it (``Trainer.close``).
    """
    free_device_memory(device)
    start = time.perf_counter()
    at_start = device_memory_allocated(device, peak=False)
    folder = run_folder(spec, dump_folder)
    shutil.rmtree(folder, ignore_errors=True)  # a checkpoint left by an earlier check would be resumed
    folder.mkdir(parents=True)  # as run_job makes it: an RL step writes its rollouts there
    config = build_config(spec, folder, device_type=device.type)
    vocab, vocab_source = resolve_vocab(config)
    trainer = build_trainer(config, spec, vocab)
    try:
        if before_training is not None:
            before_training(trainer)
        build_s = time.perf_counter() - start
        timing = _train(trainer, spec)
        result = _measure(trainer, config, spec, timing)
        if profile:
            result["breakdown"] = profile_steps(trainer)
    finally:
        closing = time.perf_counter()
        trainer.close()  # waits for an asynchronous checkpoint's write
        close_s = time.perf_counter() - closing
        trainer = None  # an exception's traceback must not keep the model alive
        free_device_memory(device)
        shutil.rmtree(folder / "checkpoint", ignore_errors=True)  # the 1B's is ~15 GB
    if "checkpoint" in result:
        result["checkpoint"]["close_wait_s"] = round(close_s, 3)
    result.update(
        build_s=round(build_s, 2),
        wall_s=round(time.perf_counter() - start, 2),
        vocab=vocab,
        vocab_source=vocab_source,
        allocated_at_start_gib=None if at_start is None else round(at_start / GIB, 3),
    )
    return result


@dataclass(frozen=True)
class _Timing:
    first_steps_s: list[float]  # each warmup step (the first one compiles under training.compile)
    timed_s: float  # the timed steps together


def _train(trainer: Trainer, spec: RunSpec) -> _Timing:
    """``warmup`` steps timed one by one, then ``steps`` steps timed together; no garbage collection in
    between, as in ``Trainer.train``. The step guard syncs the host once a step, as in a real run."""
    device = trainer.device
    trainer.data_iter = iter(trainer.data_loader)
    gc.collect()
    gc.disable()
    try:
        first: list[float] = []
        for _ in range(spec.warmup):
            t = time.perf_counter()
            trainer.run_step()
            synchronize(device)
            first.append(time.perf_counter() - t)
        synchronize(device)
        t = time.perf_counter()
        for _ in range(spec.steps):
            trainer.run_step()
        synchronize(device)
        return _Timing(first, time.perf_counter() - t)
    finally:
        gc.enable()


def _measure(trainer: Trainer, config: JobConfig, spec: RunSpec, timing: _Timing) -> dict[str, Any]:
    """Tokens/s and MFU as the trainer's metrics compute them (same FLOPs per token and peak), peak memory."""
    args, device = trainer.model_args, trainer.device
    tokens_per_step = trainer.parts.runner.step_tokens()  # world size 1: one rank holds the whole step
    tps = tokens_per_step * spec.steps / timing.timed_s if spec.steps else None
    peak = build_peak_flops(
        device, args, training=config.training, metrics=config.metrics, float8=config.float8, cp_degree=1
    )
    flops = compute_num_flops_per_token(
        trainer.num_flop_params, args.n_layers, args.n_heads, args.head_dim, spec.seq_len
    )
    peak_bytes = device_memory_allocated(device, peak=True)
    return {
        "name": spec.name,
        "status": "ok",
        **spec.describe(),
        # the block_causal kernel; causal attention always runs SDPA (model.attention_backend's help)
        "attention_backend_resolved": getattr(args, "attention_backend", None)
        if spec.mask == "block_causal"
        else "sdpa",
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": None if tps is None else round(tps, 1),
        "mfu_pct": None if tps is None else round(compute_mfu(tps, flops, peak.flops), 2),
        "peak_flops_source": peak.source,
        "flops_per_token": flops,
        "step_s": round(timing.timed_s / spec.steps, 4) if spec.steps else None,
        "first_steps_s": [round(s, 3) for s in timing.first_steps_s],
        "peak_memory_gib": None if peak_bytes is None else round(peak_bytes / GIB, 3),
        "peak_memory_bytes": peak_bytes,
        "losses": [float(loss) for loss in trainer.metrics.losses],
        **_logged(trainer, config, spec),
    }


def _logged(trainer: Trainer, config: JobConfig, spec: RunSpec) -> dict[str, Any]:
    """What the trainer itself logged or counted beyond the loss: the median of each ``LOGGED_RATES`` over the timed
    steps (an RL step's generation and update tokens/s), an image row's images per window, and a checkpointing row's
    saves (seconds each blocked training: the manager's own count; the write's wait at the end is added by ``run``)."""
    extra: dict[str, Any] = {}
    timed = trainer.metrics.fields[spec.warmup :]
    rates = {k: statistics.median(f[k] for f in timed) for k in LOGGED_RATES if timed and all(k in f for f in timed)}
    if rates:
        extra["trainer_logged"] = {k: round(v, 1) for k, v in rates.items()}
    if isinstance(trainer.data_loader, RandomImageBatches):  # an image family's row: the images each window held
        extra["images_per_row"] = len(trainer.data_loader.grids)
    ck = config.checkpoint
    if ck.enable_checkpoint:
        blocked = trainer.checkpointer.blocked_seconds
        extra["checkpoint"] = {
            "async_mode": ck.async_mode,
            "interval": ck.interval,
            "blocked_s": {str(step): round(s, 3) for step, s in sorted(blocked.items())},
        }
    return extra
