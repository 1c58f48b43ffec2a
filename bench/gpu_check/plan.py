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
        ],
        linear_attention=linear_attention(
            RunSpec("qwen3_5 0.8B", "0.8B", 4096, 2, model="qwen3_5", tokenizer=FLAVOR_VOCAB, cost_s=60)
        ),
        features=features(RunSpec("debugmodel", "debugmodel", 256, 4, warmup=0, steps=6, cost_s=20)),
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
        families=[moe, replace(moe, name="deepseek_v3 debugmodel", model="deepseek_v3")],
        linear_attention=linear_attention(replace(tiny, name="qwen3_5 tiny", model="qwen3_5", cost_s=4)),
        features=features(replace(tiny, dtype="float32", warmup=0, steps=4)),
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
