"""What bench/gpu_check runs: the GPU plan (Llama 3.2 1B / 3B shapes) and the CPU dry run's tiny twin.

Both plans have the same sections, and each section runs the same code on its runs; the dry run has smaller
shapes, fewer steps and no compiled row (see ``dry_run_plan``).
``cost_s`` is each run's expected seconds on the target (an H100 for the GPU plan; reasoning in
docs/performance.md): a run starts only if the time budget has that much left.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.gpu_check.runs import FLAVOR_VOCAB, RunSpec


@dataclass(frozen=True)
class Plan:
    sanity: RunSpec  # fp32 debug model: first losses on the device vs the CPU
    throughput: list[RunSpec]  # the 1B rows, in order of value
    profiled: RunSpec  # the throughput row whose step is also broken down (breakdown.py), as every levers row is
    estimator: list[RunSpec]  # configs whose real peak is compared with the estimate (eager, no compile)
    attention: list[RunSpec]  # causal sdpa, block_causal auto (flex on CUDA), block_causal sdpa: same data
    float8: list[RunSpec]  # the bf16 reference first, then each recipe
    families: list[RunSpec]
    linear_attention: list[RunSpec]  # Qwen3.5: the torch chunked rule, then flash-linear-attention's (same tokens)
    features: list[RunSpec]  # newer training features, each one run that must train (finite losses)
    compiled: list[tuple[RunSpec, RunSpec]]  # (a row, the row it is compared with): CUDA graphs, compiled MoE, Qwen3.5
    rl: list[RunSpec]  # an RL step (train_configs/grpo_arith.toml): generation and update tokens/s as logged
    checkpoint: list[tuple[RunSpec, RunSpec]]  # (a row saving asynchronously into pinned memory, the same without)
    levers: list[RunSpec]  # the base row, then the MFU levers (the sets that compose, then each alone)
    width_8b: list[RunSpec]  # Llama 3 8B's width at a few blocks, compiled: bf16, then each float8 recipe
    if_time_allows: list[RunSpec]  # more throughput rows, last (a longer compile, the 3B shape)


def gpu_plan() -> Plan:  # declarative table
    one_b = RunSpec("1B eager seq 2048", "1B", 2048, 4, tokenizer=FLAVOR_VOCAB, cost_s=30)
    one_b_compiled = replace(one_b, name="1B compile seq 2048", compile=True, cost_s=120)
    long = replace(one_b, name="1B eager seq 8192", seq_len=8192, batch_size=1)
    docs = replace(long, doc_len=(256, 2048), cost_s=40)  # ~8 documents a row
    # 8 blocks of 8B: ~2.8 B parameters, ~45 GB of fp32 weights, gradients and Adam moments, fits an 80 GB H100;
    # torchtitan's 8B figures are at seq 8192, local batch 1 (docs/performance.md)
    eight_b_width = RunSpec(
        "8B width x8 blocks compile seq 8192",
        "8B",
        8192,
        1,
        n_layers=8,
        compile=True,
        tokenizer=FLAVOR_VOCAB,
        cost_s=150,
    )
    three_b = RunSpec("3B eager seq 2048 full AC", "3B", 2048, 4, ac="full", tokenizer=FLAVOR_VOCAB, cost_s=45)
    qwen3_5 = RunSpec("qwen3_5 0.8B", "0.8B", 4096, 2, model="qwen3_5", tokenizer=FLAVOR_VOCAB, cost_s=60)
    qwen3_5_torch = linear_attention(qwen3_5)[0]
    return Plan(
        sanity=RunSpec("debugmodel fp32", "debugmodel", 256, 4, dtype="float32", warmup=0, steps=5, cost_s=30),
        throughput=[one_b, one_b_compiled, long],
        profiled=one_b_compiled,
        estimator=[one_b, replace(one_b, name="1B eager seq 2048 full AC", ac="full")],
        attention=[
            replace(docs, name="1B causal sdpa seq 8192"),
            replace(docs, name="1B block_causal auto seq 8192", mask="block_causal", cost_s=90),
            replace(docs, name="1B block_causal sdpa seq 8192", mask="block_causal", attention_backend="sdpa"),
        ],
        float8=float8_rows(one_b_compiled, "1B compile"),
        families=[
            RunSpec("gpt_oss debugmodel", "debugmodel", 256, 4, model="gpt_oss", warmup=0, steps=10, cost_s=25),
            RunSpec("deepseek_v3 debugmodel", "debugmodel", 256, 4, model="deepseek_v3", warmup=0, steps=10, cost_s=25),
            # block_causal: FlexAttention on CUDA, whose kernels compile in the first step (hence the warm-up)
            images(RunSpec("qwen3_5_vl debugmodel", "debugmodel", 256, 4, warmup=2, steps=5, cost_s=40)),
            # train_configs/hf_debug.toml's model: transformers' Llama class, tiny and random, built here
            RunSpec("hf llama_tiny", "llama_tiny", 256, 8, model="hf", warmup=0, steps=10, cost_s=25),
        ],
        linear_attention=linear_attention(qwen3_5),
        features=features(RunSpec("debugmodel", "debugmodel", 256, 4, warmup=0, steps=6, cost_s=20)),
        compiled=[
            (cuda_graphs(one_b_compiled, cost_s=60), one_b_compiled),
            moe_compiled(RunSpec("qwen3_moe debugmodel", "debugmodel", 2048, 4, model="qwen3_moe", cost_s=20), 45),
            moe_compiled(RunSpec("deepseek_v3 debugmodel", "debugmodel", 2048, 4, model="deepseek_v3", cost_s=20), 60),
            (
                replace(qwen3_5_torch, name="qwen3_5 0.8B compile torch rule seq 4096", compile=True, cost_s=90),
                qwen3_5_torch,
            ),
        ],
        rl=[grpo_arith(warmup=1, steps=3, cost_s=30)],
        # the 1B's checkpoint: fp32 weights and AdamW's moments, ~15 GB; one save inside the timed steps
        checkpoint=[(pinned_checkpoint(one_b, interval=4, cost_s=90), one_b)],
        levers=levers(one_b_compiled, chunk=512),
        width_8b=float8_rows(eight_b_width, "8B width x8 blocks compile"),
        if_time_allows=[
            replace(long, name="1B compile seq 8192", compile=True, cost_s=120),
            three_b,
            replace(three_b, name="3B compile seq 2048 full AC", compile=True, cost_s=150),
        ],
    )


def dry_run_plan() -> Plan:  # declarative table
    tiny = RunSpec("tiny eager seq 64", "debugmodel_tiny", 64, 2, cost_s=3)
    docs = replace(tiny, seq_len=128, doc_len=(8, 48))
    moe = RunSpec("gpt_oss debugmodel", "debugmodel", 32, 1, model="gpt_oss", warmup=0, steps=4, cost_s=6)
    deepseek = replace(moe, name="deepseek_v3 debugmodel", model="deepseek_v3")
    qwen3_5_torch = linear_attention(replace(tiny, name="qwen3_5 tiny", model="qwen3_5", cost_s=4))[0]
    # fp32 on the CPU (bf16 is ~15x slower on an AVX2-only one), as few steps as show the code runs
    small = dict(dtype="float32", warmup=0, steps=2, cost_s=4)
    tiny_compiled = replace(tiny, name="tiny compile seq 64", compile=True)
    return Plan(
        sanity=RunSpec("debugmodel_tiny fp32", "debugmodel_tiny", 64, 2, dtype="float32", warmup=0, steps=5, cost_s=10),
        # No compile row: inductor's cold compile of even the tiny model costs 15-30 s on 2 CPU cores, half
        # the dry run; training.compile is one config key, and the trainer's compile has tests of its own.
        throughput=[tiny, replace(tiny, name="tiny eager seq 128", seq_len=128, batch_size=1)],
        profiled=tiny,
        estimator=[tiny, replace(tiny, name="tiny eager seq 64 full AC", ac="full")],
        attention=[
            replace(docs, name="tiny causal sdpa seq 128"),
            replace(docs, name="tiny block_causal auto seq 128", mask="block_causal"),
            replace(docs, name="tiny block_causal sdpa seq 128", mask="block_causal", attention_backend="sdpa"),
        ],
        float8=float8_rows(tiny, "tiny"),
        families=[
            moe,
            deepseek,
            images(RunSpec("qwen3_5_vl debugmodel_tiny", "debugmodel_tiny", 64, 1, **small)),
            RunSpec("hf llama_tiny", "llama_tiny", 64, 2, model="hf", **small),
        ],
        linear_attention=linear_attention(replace(tiny, name="qwen3_5 tiny", model="qwen3_5", cost_s=4)),
        features=features(replace(tiny, dtype="float32", warmup=0, steps=4)),
        # the compiled rows are skipped here (no compile in the dry run), CUDA graphs by the pre-launch check's line
        compiled=[
            (cuda_graphs(tiny_compiled, cost_s=3), tiny_compiled),
            moe_compiled(RunSpec("qwen3_moe debugmodel_tiny", "debugmodel_tiny", 32, 1, model="qwen3_moe", **small), 3),
            (replace(deepseek, name="deepseek_v3 debugmodel compile", compile=True), deepseek),
            (replace(qwen3_5_torch, name="qwen3_5 tiny compile torch rule seq 64", compile=True), qwen3_5_torch),
        ],
        rl=[grpo_arith(warmup=0, steps=2, cost_s=8, prompts=2, group=2, new_tokens=8)],
        checkpoint=[(pinned_checkpoint(tiny, interval=4, cost_s=6), tiny)],
        levers=levers(tiny, chunk=32),
        width_8b=float8_rows(replace(tiny, name="tiny x1 block seq 64", n_layers=1), "tiny x1 block"),
        if_time_allows=[replace(tiny, name="tiny eager seq 128 full AC", seq_len=128, batch_size=1, ac="full")],
    )


def float8_rows(base: RunSpec, stem: str) -> list[RunSpec]:
    """``base`` in bf16, then with each float8 recipe (named ``stem`` + the recipe)."""
    return [base, *(replace(base, name=f"{stem} float8 {r}", float8_recipe=r) for r in ("tensorwise", "rowwise"))]


def linear_attention(base: RunSpec) -> list[RunSpec]:
    """Gated DeltaNet's chunked rule in torch, then on flash-linear-attention's kernel (run where installed)."""
    kernel = "--model.linear_attention_kernel"
    return [
        replace(base, name=f"{base.name} torch rule seq {base.seq_len}", extra=(kernel, "torch")),
        replace(base, name=f"{base.name} fla rule seq {base.seq_len}", extra=(kernel, "fla")),
    ]


def images(base: RunSpec) -> RunSpec:
    """``base`` as the image family (qwen3_5_vl) with packed samples as train_configs/qwen3_5_vl_shapes.toml trains
    them (block_causal, positions from 0 in each), each window random images and text (the memory estimator's
    batches: as many of the largest images as fit, estimation/images.py; runs.py feeds them to an image family)."""
    return replace(base, model="qwen3_5_vl", mask="block_causal", extra=("--model.positions_per_document", "true"))


def cuda_graphs(compiled: RunSpec, *, cost_s: float) -> RunSpec:
    """``compiled`` with training.cuda_graphs (its dense blocks recorded as CUDA graphs and replayed)."""
    return replace(
        compiled, name=f"{compiled.name} + CUDA graphs", extra=("--training.cuda_graphs", "true"), cost_s=cost_s
    )


def moe_compiled(family: RunSpec, cost_s: float) -> tuple[RunSpec, RunSpec]:
    """(an MoE family compiled: each block around its routed experts, the same eager), on the same tokens."""
    eager = replace(family, name=f"{family.name} seq {family.seq_len}")
    return replace(family, name=f"{family.name} compile seq {family.seq_len}", compile=True, cost_s=cost_s), eager


def grpo_arith(
    *, warmup: int, steps: int, cost_s: float, prompts: int = 8, group: int = 4, new_tokens: int = 16
) -> RunSpec:
    """An RL step: train_configs/grpo_arith.toml (GRPO on the shipped arithmetic prompts, Llama 3's debugmodel_tiny from
    random weights: the rewards stay near 0, the rates are what counts) at one process, which holds all of a step's
    completions; the spec's keys are the file's (the prompts, group and length only shrink the dry run's)."""
    rl = ("--rl.prompts_per_step", str(prompts), "--rl.group_size", str(group), "--rl.max_new_tokens", str(new_tokens))
    return RunSpec(
        f"grpo_arith {prompts}x{group} completions",
        "debugmodel_tiny",
        48,  # the file's: the longest prompt (31 tokens) + rl.max_new_tokens
        prompts * group,
        dtype="float32",
        tokenizer="./tests/assets/sft/tokenizer",
        warmup=warmup,
        steps=steps,
        cost_s=cost_s,
        extra=("--job.config_file", "train_configs/grpo_arith.toml", *rl),
    )


def pinned_checkpoint(base: RunSpec, *, interval: int, cost_s: float) -> RunSpec:
    """``base`` saving a full checkpoint every ``interval`` steps with checkpoint.async_mode = 'async_with_pinned_mem'
    (the state staged into kept host buffers, pinned on an accelerator, while training goes on). training.steps is set
    past the run's steps so that no final (synchronous) save lands in the timed steps."""
    saves = (
        *("--checkpoint.enable_checkpoint", "true", "--checkpoint.async_mode", "async_with_pinned_mem"),
        *("--checkpoint.interval", str(interval), "--training.steps", "1000"),
    )
    return replace(base, name=f"{base.name} + async pinned checkpoint", extra=saves, cost_s=cost_s)


def features(base: RunSpec) -> list[RunSpec]:  # declarative table
    """The features section's runs on ``base``'s shapes."""
    return [
        replace(
            base,
            name=f"{base.flavor} Muon + no_decay",
            extra=("--optimizer.name", "Muon", "--optimizer.no_decay", "norm,bias,embedding"),
        ),
        replace(
            base,
            name=f"{base.flavor} step replay every 2nd step",
            dtype="float32",
            extra=("--training.deterministic", "--training.replay_every_n_steps", "2"),
        ),
        replace(base, name=f"{base.flavor} LoRA r16 full AC", ac="full", extra=("--lora.enable", "--lora.rank", "16")),
    ]


def levers(base: RunSpec, chunk: int) -> list[RunSpec]:  # declarative table
    """What a user turns on for MFU at one GPU (issue 57), on ``base``: the two sets that compose first (the
    figures that count when the budget is short; pure bf16 refuses fused AdamW, whose arithmetic would be bf16),
    then each lever alone, so each one's effect is measured against ``base`` in the same invocation."""
    fused = ("--optimizer.fused", "true")  # torch's fused AdamW kernel: one launch per parameter group
    chunked = ("--training.loss_chunk_size", str(chunk))  # the 128K-vocabulary logits never all held
    pure = ("--training.dtype", "bfloat16")  # bf16 weights at world size 1: no autocast cast of each weight
    named = f"chunked loss {chunk}"
    return [
        base,
        replace(base, name=f"{base.name} + pure bf16 + {named}", extra=(*pure, *chunked)),
        replace(base, name=f"{base.name} + fused AdamW + {named}", extra=(*fused, *chunked)),
        replace(base, name=f"{base.name} + fused AdamW", extra=fused),
        replace(base, name=f"{base.name} + {named}", extra=chunked),
        replace(base, name=f"{base.name} + pure bf16", extra=pure),
    ]
