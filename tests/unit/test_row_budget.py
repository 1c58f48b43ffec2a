"""The rank-row budget: what the parity rows cost, so the suite stops growing linearly (docs/testing.md).

A rank-row is one rank training one row (a 2-rank row is 2). Counted: every distinct row (by name) in a
module-level list of ``Row`` in the run tests (tests/runs/) and the harness's row modules (tests/support/: the matrix, the references as 1-rank rows, family,
float8, in-backward, document rows; a list added by a new feature is found without registering it), plus
the estimator's accuracy rows, which its own measure launch trains again. The 8- and 16-rank rows are
4-8x oversubscribed on 2 cores: a rank-row there costs as much as one at 2 ranks.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import tests
from tests.support.matrix import Row

# 2026-11 (issue "tests that scale"): 273 rank-rows (74 rows: 229; the estimator's launch: 44) after the
# option and spelling rows were merged; before, 299 (86 rows: 255; the estimator: 44). The headroom is six
# 2-rank rows. A feature adds rows only where its code path differs (docs/testing.md); raise this with the
# rows it adds, in the same commit, and say why there. Issue 35 (fine-tuning) used the headroom: 12 rank-rows
# (tests/runs/features/test_sft_runs.py: its masked-loss reference and loss_on='all' at 1 rank, five 2-rank layouts), 285.
# Issue 36 (DeepSeek-V3, gpt-oss) raised it by 32 to 317: two new attentions (MLA; sinks with sliding windows)
# and new expert code (group-limited routing, biased clamped experts) whose TP plans, CP ring and EP paths
# differ from every existing row: per family a 1-rank reference, FSDP2, EP2, TP2 x EP2, PP2 (gpt-oss also
# CP2) at 2 ranks and FSDP2 x EP2 at 4 (tests/runs/models/test_frontier_runs.py, 28), and one estimator row each (4).
# All at the tiny flavor: the 22 jobs take ~25 s of the suite.
# Issue 46 (indexed datasets, blends) raised it by 10 to 327: a blend reads through a loader of its own (Megatron's
# rule, memory-mapped windows), so its parity needs its own reference (1) and the layouts that read it differently:
# FSDP2, FSDP2 + accumulation 2, PP2 (6); and its resume from the reference's step 3 on the same layout (1) and
# as FSDP2 (2): tests/runs/features/test_indexed_runs.py, the 6 jobs ~40 s of the suite.
# Issue 45 (item 5, MoE aux loss over the global micro-batch) raised it by 12 to 339: the switch aux loss's new
# all-reduce runs only in the flavors balanced by it, which no row trained (every tiny MoE flavor balances with
# the expert bias): gpt-oss debugmodel and qwen3_moe debugmodel_aux_loss, each a 1-rank reference, FSDP2 and EP2
# at 2 ranks (10), and the per-rank scope kept as an option, whose row must miss one process (2)
# (tests/runs/models/test_moe_aux_runs.py).
# Issue 47 (parameter groups, Muon) raised it by 7 to 346: the rules resolve per rank and per pipeline stage and
# Muon's full-matrix step gathers FSDP's and TP's shards, a path no other row takes: a 1-rank reference with the
# no-decay preset, a multiplier and a Muon rule, and FSDP2, TP2, PP2 1F1B at 2 ranks (tests/runs/features/test_param_group_runs.py).
# Issue 48 (LoRA) raised it by 22 to 368 (18, then +2, +2): LoRA's losses are not the full rows' (frozen base, adapters), so no
# existing row can carry it; per family (llama3, qwen3) a 1-rank LoRA reference and FSDP2, TP2 (the adapter
# styles of lora/tensor_parallel.py), PP2 1F1B and FSDP2 + accumulation 2 at 2 ranks (tests/runs/features/test_lora_runs.py);
# +2 for llama3's LoRA CP2 row; +2 for lora_llama3_fsdp2 in the estimator's launch (the frozen base's memory).
# Issue 48 item 5 (QLoRA) raised it by 3 to 371: the NF4 base is all-gathered by FSDP through torchao's extension and
# quantized whole per rank, a path no LoRA row takes, and its losses are not LoRA's: a 1-rank QLoRA reference and
# FSDP2 (+ full AC) at 2 ranks (tests/runs/features/test_qlora_runs.py; its 30-step run and the estimator check are 1-rank pool
# jobs, not rows).
# Issue 48 (LoRA on the MoE families) raised it by 5 to 376: the adapters beside frozen grouped experts, whose EP
# shards must stay frozen and whose expert bias must not move, are a path no LoRA row takes, and the losses are not
# the dense rows': a 1-rank qwen3_moe LoRA reference and FSDP2, EP2 at 2 ranks (tests/runs/features/test_lora_moe_runs.py; its
# frozen-base check under EP2 for llama3_moe and qwen3_moe and the estimator check are pool jobs, not rows).
# Issue 57 (pure bf16 training) raised it by 4 to 380: bf16 parameters with no autocast and the fp32 update written
# back to bf16 are a path no row takes, and their losses are not mixed precision's: a 1-rank pure-bf16 reference and
# FSDP2, TP2, PP2 1F1B at 2 ranks (tests/support/matrix.py, PURE_BF16_ROWS), +2 for bf16_pure_fsdp2 in the
# estimator's launch (the halved bytes); paid in part by merging fsdp2_bf16 into fsdp2_tp2_bf16 and cp2_bf16 (-2)
# and by no pure CP row (its ring runs as under FSDP's bf16 policy, cp2_bf16).
# Issue 58 (RL) raised it by 18 to 398: the RL step (generation under each layout, the policy loss with weights over
# the whole update, the reference, the rollouts' file) is a path no row takes, and its losses are not the LM rows':
# a 1-rank reference and its file-driven twin (2), FSDP2, TP2, FSDP2 + accumulation 2 at 2 ranks and HSDP 2x2 at 4
# (10), greedy generation at 1 and 2 ranks (3), resume on 1 and 2 ranks (3) (tests/runs/features/test_rl_runs.py: its 13 jobs take
# ~20 s of the suite on the nano flavor).
# Issue 58 (the RL step in the memory estimator) raised it by 4 to 402: the estimator's launch trains the RL step (one
# group generated at full length, the update with its frozen reference) as FSDP2 and DDP at 2 ranks, paths no other
# estimator row takes (a second FSDP root, the reference left out of DDP); its TP2 row runs with all rows only.
# Issue 61 (any transformers causal LM, model.name = "hf") raised it by 30 to 432: transformers' own layers under our
# FSDP, DDP, TP (each model's base_model_tp_plan) and AC are a path no native row takes, and every architecture is
# its own code: per architecture (Mistral, Gemma 3, OLMo 2, SmolLM3, Phi-3, Qwen3-MoE) a 1-rank reference and a
# data-parallel row (AC modes and DDP ride on them), and TP2 where built (5), and one resume on FSDP2
# (tests/runs/models/test_hf_model_runs.py: its 19 jobs take ~25 s of the suite at 2 layers, seq 64).
# Issue 61 (LoRA on the hf family) raised it by 5 to 437: the adapters on transformers' linears (targets read from its
# layers, TP's adapter styles over its own plan, the frozen base re-frozen after it) are a path no LoRA or hf row
# takes, and the losses are not the full rows': a 1-rank LoRA reference on the Mistral export and FSDP2, TP2 at 2
# ranks (tests/runs/models/test_hf_model_runs.py). Its fine-tuning data with documents rides on SmolLM3's existing rows.
# The same issue's estimator row raised it by 2 to 439: hf_mistral_fsdp2 in the estimator's launch (transformers'
# masks under fake tensors, tests/runs/estimation/test_estimation.py).
# Issue 59 (Qwen3.5) raised it by 11 to 450: Gated DeltaNet (a recurrence, a causal convolution, per-document
# restarts) is a path no row takes, and the family's losses are its own: a 1-rank reference and FSDP2, FSDP2 +
# accumulation 2, PP2 1F1B at 2 ranks and HSDP 2x2 at 4, all with block_causal documents on the short-document
# corpus (tests/runs/models/test_qwen3_5_runs.py: 5 jobs, ~9 s); +2 to 452 for qwen3_5_fsdp2 in the estimator's launch (the chunked
# recurrence's activations).
# The same issue's MoE (qwen3_5_moe) raised it by 3 to 455: the hybrid with MoE feed-forwards (the gated shared
# expert, expert parallel beside Gated DeltaNet) has its own losses: a 1-rank reference, FSDP2 + EP2 at 2 ranks, and
# HSDP 2x2 + EP2 at 4, which replaced the dense hybrid's HSDP 2x2 row (HSDP's path is the same for both; 4 jobs'
# worth of ranks kept by riding on it).
# The same issue's tensor parallel raised it by 2 to 457: Gated DeltaNet sharded by heads (grouped q/k/v rows, the
# convolution and A_log/dt_bias as Shard(0) DTensors) is a path no row takes: TP2 for the dense hybrid and TP2 x EP2
# for the MoE (+4), paid in part by dropping the dense hybrid's plain FSDP2 row (-2), whose path its FSDP2 +
# accumulation row runs.
# Issue 60 (images) raised it by 9 to 466: image-text batches (the tower's patches, image features scattered into
# the embedding, per-sample multimodal positions riding on the documents) are a path no row takes, and their losses
# are their own: a 1-rank reference and FSDP2 + accumulation 2 (the tower its own FSDP unit), TP2 (the embedding left
# whole until the images are placed, the tower replicated), PP2 1F1B (the tower on the first stage, images split per
# micro-batch) and FSDP2 with model.freeze_vision at 2 ranks (tests/runs/models/test_vlm_runs.py: 5 jobs, ~12 s at the tiny flavor);
# +2 to 468 for qwen3_5_vl_fsdp2 in the estimator's launch (the tower's activations on its assumed image batches).
# +2 to 470 for vl_fsdp2_lora: LoRA over image batches (every tower unit frozen under FSDP, the blank image's
# collectives with no trainable tower parameter) is a path neither the LoRA rows nor freeze_vision's take.
# Issue 85 (activation_checkpoint.mode = "memory_budget") used 2 of the headroom, to 465: fsdp2_memory_budget in the
# estimator's launch (compiled blocks under FSDP's tracker, their partitioned graphs run op by op); its losses are a
# 1-rank pool job's (tests/runs/training/test_memory_options.py), not a row.
# Issue 87 took 4 of the 5 left, to 469: an MoE policy's generation (the experts' all-to-all in every decoding step,
# each rank's batch of prompts) and its update under expert parallel are a path no RL or MoE row takes: a 1-rank
# reference and grpo_arith_moe.toml's layout, FSDP over 2 with expert parallel 2 (3); and asynchronous rollouts, whose
# generator is a process beside the ranks, one 1-rank run (1) (tests/runs/features/test_rl_runs.py: ~40 s).
# Issue 86 item 2 (DeepSeek-V3.2's sparse attention) raised it by 5 to 475 (6 rank-rows, one of the headroom): the
# indexer's top-k mask inside MLA and its KL loss in the backward are a path no row takes, and the dense warm-up
# (every block frozen but its indexer, the block kept in the graph for FSDP's hooks) another: per stage a 1-rank
# reference and FSDP2 at 2 ranks (tests/runs/models/test_dsa_runs.py: 4 jobs, ~8 s of job time at the tiny flavor).
# Expert parallel, HSDP and accumulation change nothing in DSA's attention and ride on deepseek_v3's rows; CP, TP
# and PP are refused before launch.
# Issue 86 (DeepSeek-V4) raised it by 3 more to 478: hyper-connection streams, compressed attention and hash
# routing through FSDP and expert parallel are a path no row takes, and the family's losses are its own: a 1-rank
# reference and FSDP2 with EP2 over the same 2 ranks (tests/runs/models/test_frontier_runs.py: 2 jobs, ~4 s).
# Issue 86 item 1 (multi-token prediction) raised it by 6 more to 484: the depth after the model (its own FSDP unit, its
# experts split by EP, the depths' loss beside the model's) is a path no row takes, and its losses are not the frontier
# rows': a 1-rank MTP reference, FSDP2 and EP2 at 2 ranks (5), and lambda = 0 at 1 rank against the frontier
# reference's losses (1) (tests/runs/models/test_mtp_runs.py: its 5 jobs and the published-folder job ~30 s).
# Issue 86 item 1 (MTP under tensor parallel) raised it by 2 to 486: the depth's own sequence-parallel modules, its
# block under the blocks' TP plan and its vocab-sharded logits in the loss are a path no row takes: TP2 x EP2 at 2
# ranks against the MTP reference above (dsv3_mtp_tp2_ep2: ~5 s of job time; TP needs EP on an MoE family).
# Issue 86 item 3 (DeepSeek-V4 under pipeline parallel) raised it by 2 more, to 488: the hc streams (bs, n, hc, dim) sent
# between stages, hc_head on the last stage only and the hash layer fed the token ids on the first are a path no row
# takes: PP2 1F1B at 2 ranks against the frontier reference (tests/runs/models/test_frontier_runs.py, dsv4_pp2_1f1b:
# one job, 3-4.5 s measured).
# Issue 86 item 1 (MTP under pipeline parallel) raised it by 2 more, to 490: the tokens ahead embedded on the first stage
# and sent down beside the hidden state, the depth on the last stage and its term in the schedule's loss are a path
# no row takes: PP2 1F1B at 2 ranks against the MTP reference above (dsv3_mtp_pp2_1f1b: ~3 s of job time).
RANK_ROW_BUDGET = 490
SUPPORT = Path(__file__).resolve().parents[1] / "support"


# the estimator's rows are counted as its launch trains them (rank_rows): its file and its rows' module are skipped
ESTIMATOR_MODULES = ("test_estimation", "estimation_rows")


def _row_modules() -> list[str]:
    """The modules that may hold rows: the run tests (tests/runs) and the harness modules that build ``Row``s."""
    names = []
    for info in pkgutil.walk_packages(tests.__path__, "tests."):
        parts = info.name.split(".")
        if info.ispkg or parts[-1] in ESTIMATOR_MODULES or parts[1] in ("unit", "distributed"):
            continue
        if parts[-1].startswith("test_"):
            names.append(info.name)
        elif parts[1] == "support" and "Row(" in (SUPPORT / f"{parts[-1]}.py").read_text():
            names.append(info.name)  # the others (a script, a model family's registration) are not imported here
    return names


def _row_lists() -> dict[str, list[Row]]:
    found = {}
    for module_name in _row_modules():
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if isinstance(value, (list, tuple)) and value and all(isinstance(r, Row) for r in value):
                found[f"{module_name}.{name}"] = list(value)
    return found


def rank_rows() -> tuple[int, dict[str, int]]:
    """(total rank-rows, per distinct row name its ranks) as the budget counts them."""
    rows: dict[str, int] = {}
    for values in _row_lists().values():
        for row in values:
            rows[row.name] = row.ngpu
    from tests.support.estimation_rows import RSS_ROWS, TRACKER_ROWS

    measured = sum(r.ngpu for r in TRACKER_ROWS + RSS_ROWS)
    return sum(rows.values()) + measured, rows


def test_rank_rows_stay_within_the_budget():
    total, rows = rank_rows()
    print(f"\n{len(rows)} rows, {total} rank-rows (budget {RANK_ROW_BUDGET})")
    assert total <= RANK_ROW_BUDGET, (
        f"{total} rank-rows > the budget {RANK_ROW_BUDGET}: a new feature adds rows only where its code path "
        "differs, and options ride on existing layout rows (docs/testing.md); raise the budget only with a reason"
    )


def test_the_budget_counts_a_new_row_list(monkeypatch):
    """A Row list a new feature adds to a test module is counted, and past the budget the test fails."""
    import tests.support.matrix as matrix

    before, _ = rank_rows()
    extra = [Row(f"budget_probe_{i}", 8, 1) for i in range(3)]
    monkeypatch.setattr(matrix, "PROBE_ROWS", extra, raising=False)
    after, _ = rank_rows()
    assert after == before + 24
    monkeypatch.setattr(matrix, "PROBE_ROWS", [Row(f"budget_probe_{i}", 16, 1) for i in range(20)], raising=False)
    try:
        test_rank_rows_stay_within_the_budget()
    except AssertionError as e:
        assert "rank-rows > the budget" in str(e)
    else:
        raise AssertionError("320 more rank-rows did not fail the budget test")
