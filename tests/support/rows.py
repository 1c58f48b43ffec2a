"""The feature rows that more than one test file trains or measures: each feature's run tests and the estimator.

Each list is a feature's matrix rows (``Row``: a layout and its arguments, tests/support/matrix.py) with the arguments
they are built from; the rest of a feature's rows stay in its run test (tests/runs/).
"""

from __future__ import annotations

import dataclasses

from tests.support.matrix import AC_FULL, AC_OP, ASYNC, ROTATE_ALLGATHER, ROTATE_ALLTOALL, HSDP_2x2, Row, pp_schedule
from tests.support.runs import GLOBAL_BATCH

# ---- float8 (tests/runs/features/test_float8_runs.py)
FLOAT8 = ["--float8.enable_float8_linear"]
# FSDP all-gathers the weights in float8, their scales computed in one all-reduce after each step
FSDP_FLOAT8 = [*FLOAT8, "--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]
FLOAT8_ROWS = [
    Row("float8_fsdp2", 2, 4, FSDP_FLOAT8),
    Row("float8_tp2", 2, 8, FLOAT8, tp=2),
    Row("float8_fsdp2_tp2", 4, 4, FSDP_FLOAT8, tp=2),
    Row("float8_async_tp2", 2, 8, [*FLOAT8, *ASYNC], tp=2),
    Row("float8_pp2", 2, 8, [*FLOAT8, *pp_schedule("1F1B")], pp=2),
]


# ---- DeepSeek-V3 and gpt-oss (tests/runs/models/test_frontier_runs.py)


def frontier_family(name: str, ep: int = 1) -> list[str]:
    return ["--model.name", name, "--experimental.expert_parallel_degree", str(ep)]


def _frontier_rows(short: str, name: str, compiled: str) -> list[Row]:
    """The family's layouts; the one named ``compiled`` runs with training.compile (its MoE blocks compiled around the
    routed experts) against the same eager one-process run, as the matrix's moe_ep2_compile does."""
    rows = [
        Row(f"{short}_fsdp2", 2, 4, frontier_family(name)),
        Row(f"{short}_ep2", 2, 4, frontier_family(name, ep=2)),  # dp_shard 2 = ep 2: 2 of the 4 experts per rank
        Row(f"{short}_fsdp2xep2", 4, 2, frontier_family(name, ep=2)),  # dp_shard 4 = the experts' FSDP 2 x ep 2
        Row(f"{short}_tp2_ep2", 2, 8, frontier_family(name, ep=2), tp=2),  # the EP group is the TP group
        Row(f"{short}_pp2_1f1b", 2, 8, [*frontier_family(name), *pp_schedule("1F1B")], pp=2),
    ]
    return [
        dataclasses.replace(row, name=f"{row.name}_compile", overrides=[*row.overrides, "--training.compile"])
        if row.name == f"{short}_{compiled}"
        else row
        for row in rows
    ]


FRONTIER_REFERENCES = [
    Row("dsv3_1proc", 1, GLOBAL_BATCH, frontier_family("deepseek_v3")),
    Row("gpt_oss_1proc", 1, GLOBAL_BATCH, frontier_family("gpt_oss")),
    Row("dsv4_1proc", 1, GLOBAL_BATCH, frontier_family("deepseek_v4")),
]
DSV3_ROWS = _frontier_rows("dsv3", "deepseek_v3", compiled="ep2")
GPT_OSS_ROWS = [
    *_frontier_rows("gpt_oss", "gpt_oss", compiled="tp2_ep2"),
    Row("gpt_oss_cp2", 2, 8, frontier_family("gpt_oss"), cp=2),
]
# DeepSeek-V4: FSDP2 with its experts split over the same 2 ranks (EP2), and PP2 1F1B (the hc streams between the
# stages, the hash layer 0 on the first); TP and CP are refused
DSV4_ROWS = [
    Row("dsv4_ep2", 2, 4, frontier_family("deepseek_v4", ep=2)),
    Row("dsv4_pp2_1f1b", 2, 8, [*frontier_family("deepseek_v4"), *pp_schedule("1F1B")], pp=2),
]
# ---- tied embeddings, Qwen3, Qwen3-MoE (tests/runs/models/test_model_family_runs.py)
TIED = ["--model.flavor", "debugmodel_tied_tiny"]
TIED_REFERENCE = Row("tied_1proc", 1, GLOBAL_BATCH, TIED)
TIED_ROWS = [
    Row("tied_fsdp2", 2, 4, TIED),
    Row("tied_tp2", 2, 8, TIED, tp=2),
    Row(
        "tied_ddp2",
        2,
        4,
        [*TIED, "--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "1"],
    ),
]
QWEN3 = ["--model.name", "qwen3"]
QWEN3_REFERENCE = Row("qwen3_1proc", 1, GLOBAL_BATCH, QWEN3)
QWEN3_ROWS = [
    Row("qwen3_fsdp2", 2, 4, QWEN3),
    Row("qwen3_tp2", 2, 8, QWEN3, tp=2),
    Row("qwen3_pp2", 2, 8, [*QWEN3, *pp_schedule("1F1B")], pp=2),
    Row("qwen3_cp2", 2, 8, [*QWEN3, *ROTATE_ALLTOALL], cp=2),
]
QWEN3_MOE = ["--model.name", "qwen3_moe"]
QWEN3_MOE_REFERENCE = Row("qwen3_moe_1proc", 1, GLOBAL_BATCH, QWEN3_MOE)
QWEN3_MOE_ROWS = [
    Row("qwen3_moe_ep2", 2, 4, [*QWEN3_MOE, "--experimental.expert_parallel_degree", "2"]),
    Row("qwen3_moe_fsdp2_ep2", 4, 2, [*QWEN3_MOE, "--experimental.expert_parallel_degree", "2"]),
]
# ---- the optimizer step in backward (tests/runs/features/test_optimizer_in_backward_runs.py)
NO_CLIP = ["--training.max_norm", "0"]
IB = [*NO_CLIP, "--optimizer.early_step_in_backward"]
# the regular optimizer on one process: what every in-backward row is compared with
NO_CLIP_REFERENCE = Row("no_clip", 1, GLOBAL_BATCH, NO_CLIP)
IB_ROWS = [
    Row("ib_1proc", 1, GLOBAL_BATCH, IB),
    Row("ib_fsdp2", 2, 4, IB),
    Row("ib_fsdp2_cpu_offload", 2, 4, [*IB, "--training.enable_cpu_offload"]),
    Row("ib_fsdp2_ac_full", 2, 4, [*IB, "--activation_checkpoint.mode", "full"]),
    Row("ib_pp2_1f1b", 2, 8, [*IB, *pp_schedule("1F1B")], pp=2),  # 4 micro-batches accumulate, then the step
    Row("ib_hsdp_2x2", 4, 2, [*IB, *HSDP_2x2]),
    Row("ib_fsdp2_tp2", 4, 4, IB, tp=2),  # SP's norm weights: partial gradients reduced in the hook
    Row("ib_pp2_fsdp2", 4, 4, [*IB, *pp_schedule("1F1B", 2)], pp=2),  # FSDP's hook after the last micro-batch
]
# ---- LoRA (tests/runs/features/test_lora_runs.py)
LORA = ["--lora.enable", "--lora.rank", "4", "--lora.alpha", "32"]
ACCUM2 = ["--training.gradient_accumulation_steps", "2"]


def _lora_rows(family: str, ac: list[str]) -> tuple[Row, list[Row]]:
    """``ac``: an activation-checkpointing mode riding on the FSDP2 row (numerically neutral)."""
    args = [*LORA, "--model.name", family]
    reference = Row(f"lora_{family}_1proc", 1, GLOBAL_BATCH, args)
    return reference, [
        Row(f"lora_{family}_fsdp2", 2, 4, [*args, *ac]),
        Row(f"lora_{family}_tp2", 2, 8, args, tp=2),
        Row(f"lora_{family}_pp2_1f1b", 2, 8, [*args, *pp_schedule("1F1B")], pp=2),
        Row(f"lora_{family}_fsdp2_accum2", 2, 2, [*args, *ACCUM2]),
    ]


LORA_LLAMA_REFERENCE, LORA_LLAMA_ROWS = _lora_rows("llama3", AC_FULL)
LORA_QWEN3_REFERENCE, LORA_QWEN3_ROWS = _lora_rows("qwen3", AC_OP)
# context parallel: the adapters see each rank's sequence shard (one family: nothing family-specific in it)
LORA_LLAMA_ROWS.append(Row("lora_llama3_cp2", 2, 8, [*LORA, "--model.name", "llama3", *ROTATE_ALLGATHER], cp=2))
LORA_REFERENCES = [LORA_LLAMA_REFERENCE, LORA_QWEN3_REFERENCE]  # counted by the rank-row budget
LORA_ROWS = [*LORA_LLAMA_ROWS, *LORA_QWEN3_ROWS]
# ---- the runs' arguments of RL, model.name = "hf" and fine-tuning (tests/runs/features/test_rl_runs.py,
# tests/runs/models/test_hf_model_runs.py, tests/runs/features/test_sft_runs.py)
RL_STEPS = 3
RL = [
    *("--job.config_file", "./train_configs/grpo_arith.toml", "--model.flavor", "debugmodel_nano"),
    *("--rl.algorithm", "dapo", "--rl.clip_high", "0.28", "--rl.kl_coef", "0.1"),
    *("--rl.prompts_per_step", "4", "--rl.group_size", "3", "--rl.updates_per_step", "3", "--rl.max_new_tokens", "8"),
    *("--rl.reward", "tests.support.rl_rewards:digits", "--optimizer.lr", "1e-2", "--training.seq_len", "40"),
    *("--training.steps", str(RL_STEPS), "--training.warmup_steps", "0", "--metrics.log_freq", "1"),
]
# an MoE policy (train_configs/grpo_arith_moe.toml: Qwen3-MoE's tiny flavor, expert parallel 2) under the same run
# (the config file and its flavor in place of RL's first four arguments: grpo_arith.toml's, the nano flavor)
RL_MOE = ["--job.config_file", "./train_configs/grpo_arith_moe.toml", *RL[4:]]
# multi-turn episodes (train_configs/grpo_calc.toml) on the nano flavor: a turn ends at any of the first 200 ids, so a
# random policy's turns are short, and tests/support/rl_environments.py answers each episode's first turn
RL_CALC = [
    *("--job.config_file", "./train_configs/grpo_calc.toml", "--model.flavor", "debugmodel_nano"),
    *(
        "--rl.environment",
        "tests.support.rl_environments:ReplyOnce",
        "--rl.stop_ids",
        ",".join(map(str, range(2, 200))),
    ),
    *("--rl.prompts_per_step", "2", "--rl.group_size", "3", "--rl.max_new_tokens", "40", "--training.seq_len", "72"),
    *("--optimizer.lr", "1e-2", "--training.steps", "2", "--metrics.log_freq", "1", "--rl.temperature", "1.5"),
]
HF_STEPS = 4
HF = [
    *("--job.config_file", "./train_configs/hf_debug.toml", "--training.steps", str(HF_STEPS)),
    *("--metrics.log_freq", "1", "--training.seq_len", "64", "--training.warmup_steps", "0", "--optimizer.lr", "1e-2"),
]
SFT_ASSETS = "./tests/assets/sft"
SFT_TRAIN = [
    "--model.tokenizer_path",
    f"{SFT_ASSETS}/tokenizer",
    "--model.attn_mask_type",
    "block_causal",
    "--model.positions_per_document",
    "--training.dataset",
    "sft_arith",
    "--training.dataset_format",
    "chat",
    "--training.seq_len",
    "128",
]
