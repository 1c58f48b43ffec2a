"""RL's parts in process: advantages, token weights, the clipped loss and its KL, rewards and their errors, the
prompt sampler, top-p sampling, the generator's log-probs, log-probs that are not finite, the pre-launch refusals."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from torchtitan.components.generation import Sampling, generate
from torchtitan.components.run_control import NonFiniteStep
from torchtitan.config.manager import JobConfig
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.features.rl.checks import check_rl, check_rl_machine
from torchtitan.features.rl.losses import Clip, count_nonfinite_logprobs, group_advantages, policy_loss, token_weights
from torchtitan.features.rl.prompts import PromptSource
from torchtitan.features.rl.rewards import exact_match, format_reward, load_reward, number_match, score
from torchtitan.features.rl.rollouts import Rollout, RolloutFile, cut_at_stop, update_batch
from torchtitan.preflight.__main__ import main as preflight

PROMPTS = "tests/assets/rl/arith_prompts.jsonl"
TOKENIZER = "tests/assets/sft/tokenizer"


def test_group_advantages_normalize_per_group():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_advantages(rewards, std_normalize=True)
    std = rewards[0].std().item()
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(adv[1], torch.zeros(4)), "equal rewards: no signal, and no NaN"
    dr = group_advantages(rewards, std_normalize=False)  # Dr. GRPO
    assert torch.equal(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_token_weights_sequence_mean_vs_token_level():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    grpo = token_weights(mask, algorithm="grpo")
    assert torch.allclose(grpo[0, :2], torch.tensor([0.25, 0.25])) and torch.allclose(grpo[1], torch.full((4,), 0.125))
    dapo = token_weights(mask, algorithm="dapo")
    assert torch.allclose(dapo[mask], torch.full((6,), 1 / 6))
    for w in (grpo, dapo):
        assert math.isclose(w.sum().item(), 1.0, rel_tol=1e-6) and w[~mask].eq(0).all()


def test_token_weights_leave_nonfinite_logprobs_out_of_every_denominator():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    finite = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    # grpo: sequence 0 averages its 2 finite tokens; sequence 2, left with none, is not one of the sequences averaged
    grpo = token_weights(mask, algorithm="grpo", finite=finite)
    assert grpo.tolist() == [[0.25, 0.0, 0.25, 0.0], [0.25, 0.25, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert token_weights(mask, algorithm="dapo", finite=finite)[mask & finite].tolist() == [0.25] * 4
    random = torch.rand(6, 9, generator=torch.Generator().manual_seed(0)) < 0.6
    for m in (mask, random):  # every log-prob finite: today's weights, bit for bit
        for algorithm in ("grpo", "dapo"):
            want = token_weights(m, algorithm=algorithm)
            assert torch.equal(token_weights(m, algorithm=algorithm, finite=torch.ones_like(m)), want)


def test_nonfinite_engine_logprobs_are_masked_counted_and_stop_past_the_share():
    nan, inf = float("nan"), float("inf")
    rows = [  # JSON's NaN, Infinity and null (an engine that could not score a token) for 3 of 6 tokens
        Rollout(1, 0, 0, [5, 6], [8, 9, 2], [-0.1, nan, None], 1.0),
        Rollout(1, 0, 0, [5, 6], [7, 9, 2], [-inf, -0.4, -0.5], 0.0),
    ]
    batch = update_batch(rows, [1.0, -1.0], seq_len=6, pad_id=2)
    assert batch.finite[:, 1:4].tolist() == [[True, False, False], [False, True, True]]
    assert batch.old_logprobs.isfinite().all() and batch.nonfinite_tokens() == (3, 6)
    weights = token_weights(batch.mask, algorithm="grpo", finite=batch.finite)
    new = torch.full(batch.labels.shape, -0.3, requires_grad=True)
    loss, stats = policy_loss(new, batch.old_logprobs, batch.advantages, weights, Clip(0.2, 0.2))
    loss.backward()
    assert loss.isfinite() and new.grad.isfinite().all() and all(v.isfinite() for v in stats.values())
    # the same loss as the batch whose non-finite tokens were never trained: each sequence the mean of its others
    finite_only = batch.mask & batch.finite
    want, _ = policy_loss(
        new, batch.old_logprobs, batch.advantages, token_weights(finite_only, algorithm="grpo"), Clip(0.2, 0.2)
    )
    assert torch.equal(loss, want) and new.grad[~finite_only].eq(0).all()
    assert count_nonfinite_logprobs(batch, 1, max_share=0.5, rollouts_path="r.jsonl") == 3  # 3 of 6 is not > 0.5
    with pytest.raises(NonFiniteStep) as e:
        count_nonfinite_logprobs(batch, 7, max_share=0.01, rollouts_path="r.jsonl")
    assert str(e.value).startswith(
        "step 7: 3 of its 6 completion tokens (50.0%) have a generator log-prob that is not finite (NaN, inf or null; "
        "read from rl.rollouts_path r.jsonl), more than rl.max_nonfinite_logprob_share = 0.01; stopped before"
    )
    assert "\n" not in str(e.value)


def test_rollout_file_takes_its_own_runs_rows_and_says_why_once(tmp_path, caplog):
    # the second engine/trainer pair of docs/rl.md in one file: the earlier run's rows come first
    path = tmp_path / "rollouts.jsonl"
    rows = [Rollout(1, 0, 0, [5], [7, 2], [-0.5, -0.1], float(i)).record(run) for run in ("old", "new") for i in (0, 1)]
    rows.append(Rollout(2, 0, 0, [5], [8, 2], [-0.5, -0.1], 0.0).record("old"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    file = RolloutFile(str(path), run="new")
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        taken = file.take(1, 2, wait_s=0)
    assert [(r.step, r.reward) for r in taken] == [(1, 0.0), (1, 1.0)] and file.foreign == {"old": 3}
    told = [r.getMessage() for r in caplog.records if "left aside" in r.getMessage()]
    assert len(told) == 1 and "rows made from run old's policy are left aside (an earlier run's rows" in told[0]
    assert "or with --run new" in told[0] and "restart the engine" not in told[0]  # nothing is wrong with the engine
    with pytest.raises(
        ValueError, match=r"step 2 needs 2 rollouts .* of this run \(new\) and it has 0 .*3 rows of run old"
    ):
        file.take(2, 2, wait_s=0)


def test_policy_loss_clips_each_side_and_k3_kl():
    weights = torch.tensor([[0.5, 0.5]])
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)  # ratios 1.5 and 0.5
    clip = Clip(low=0.2, high=0.28)
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), weights, clip)
    # positive advantage: min(r A, clip(r) A) -> 1.28 (clipped high) and 0.5 (the unclipped, lower one)
    assert math.isclose(loss.item(), -(0.5 * 1.28 + 0.5 * 0.5), rel_tol=1e-6)
    assert math.isclose(stats["clip_fraction"].item(), 0.5, rel_tol=1e-6)
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] != 0, "the clipped token gets no gradient"
    neg, _ = policy_loss(new.detach(), old, torch.tensor([-1.0]), weights, clip)
    assert math.isclose(neg.item(), 0.5 * 1.5 + 0.5 * 0.8, rel_tol=1e-6), "negative advantage: clipped at 1 - low"
    ref = torch.zeros(1, 2)
    _, with_kl = policy_loss(new.detach(), old, torch.tensor([1.0]), weights, clip, ref_logprobs=ref, kl_coef=0.1)
    delta = ref - new.detach()
    assert math.isclose(with_kl["kl"].item(), (0.5 * (delta.exp() - delta - 1)).sum().item(), rel_tol=1e-6)


def test_shipped_rewards():
    row = {"answer": "3 plus 4 is 7."}
    assert exact_match(prompt="", completion=" 3 plus 4 is 7. ", row=row) == 1.0
    assert exact_match(prompt="", completion="3 plus 4 is 8.", row=row) == 0.0
    assert number_match(prompt="", completion="It is 7", row=row) == 1.0
    assert format_reward(prompt="", completion="9 plus 9 is 1.", row=row) == 1.0
    assert format_reward(prompt="", completion="seven", row=row) == 0.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("torchtitan.features.rl.rewards", "expected 'module:function'"),
        ("no_such_module_xyz:f", "module 'no_such_module_xyz' cannot be imported"),
        ("torchtitan.features.rl.rewards:nope", "torchtitan.features.rl.rewards has no function 'nope' (it has: "),
    ],
)
def test_bad_reward_names_refused(spec, message):
    with pytest.raises(ValueError, match="rl.reward") as e:
        load_reward(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_reward_errors_name_function_row_and_value():
    fn = load_reward("tests.support.rl_rewards:not_a_number")
    with pytest.raises(ValueError) as e:
        score(fn, "tests.support.rl_rewards:not_a_number", prompt="p", completion="c", row={}, where="prompt row 7")
    assert "returned 'yes' (str) on prompt row 7" in str(e.value)
    with pytest.raises(ValueError, match=r"raised KeyError: 'answer' on prompt row 2"):
        score(
            exact_match,
            "torchtitan.features.rl.rewards:exact_match",
            prompt="p",
            completion="c",
            row={},
            where="prompt row 2",
        )
    with pytest.raises(ValueError, match="returned nan"):
        score(lambda **_: float("nan"), "m:f", prompt="p", completion="c", row={}, where="row 1")


@pytest.fixture(scope="module")
def prompts() -> PromptSource:
    tokenizer = ChatTokenizer(TOKENIZER)
    return PromptSource(PROMPTS, tokenizer, seed=3, per_step=8, group_size=4, max_new_tokens=16, seq_len=48)


def test_prompts_are_a_function_of_seed_and_step(prompts):
    again = PromptSource(
        PROMPTS, ChatTokenizer(TOKENIZER), seed=3, per_step=8, group_size=4, max_new_tokens=16, seq_len=48
    )
    assert [p.index for p in prompts.sample(5)] == [p.index for p in again.sample(5)]
    assert [p.index for p in prompts.sample(5)] != [p.index for p in prompts.sample(6)]
    n = len(prompts.prompts)
    steps = n // 8  # one epoch: every row once
    seen = [p.index for s in range(1, steps + 1) for p in prompts.sample(s)]
    assert len(set(seen)) == len(seen) == steps * 8
    assert [p.index for p in prompts.sample(5, round=1)] != [p.index for p in prompts.sample(5)]
    assert prompts.prompts[0].row["answer"] == "0 plus 0 is 0." and prompts.prompts[0].text.endswith("assistant\n")


def test_update_batch_aligns_labels_and_logprobs():
    r = Rollout(1, 0, 0, [5, 6, 7], [8, 9, 2], [-0.1, -0.2, -0.3], 1.0)
    batch = update_batch([r], [0.5], seq_len=8, pad_id=2)
    assert batch.inputs[0].tolist() == [5, 6, 7, 8, 9, 2, 2, 2]
    assert batch.labels[0].tolist() == [-100, -100, 8, 9, 2, -100, -100, -100]
    assert torch.allclose(batch.old_logprobs[0, 2:5], torch.tensor([-0.1, -0.2, -0.3]))
    assert cut_at_stop([4, 2, 9], [-1.0, -2.0, -3.0], {2}) == ([4, 2], [-1.0, -2.0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    picks = {Sampling(temperature=1.0, top_p=0.75).pick(logits, g).item() for _ in range(200)}
    assert picks == {0, 1}


def test_generator_logprobs_are_the_forward_logprobs():
    from torchtitan.models.llama.model import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, multiple_of=32, max_seq_len=64))
    model.init_weights()
    prompt = torch.tensor([[3, 4, 5, 6]] * 3)
    logprobs: list[torch.Tensor] = []
    sampling = Sampling(temperature=0.7)
    out = generate(model, prompt, 6, sampling, generator=torch.Generator().manual_seed(1), logprobs=logprobs)
    with torch.no_grad():
        full = (model(out[:, :-1]) / 0.7).log_softmax(-1)
    want = full[:, 3:].gather(-1, out[:, 4:, None]).squeeze(-1)
    assert torch.allclose(torch.stack(logprobs, 1), want, atol=1e-5)
    padded: list[torch.Tensor] = []  # tensor parallel's padding of each step's new tokens changes nothing
    again = generate(
        model, prompt, 6, sampling, generator=torch.Generator().manual_seed(1), logprobs=padded, pad_multiple=4
    )
    assert torch.equal(again, out) and torch.allclose(torch.stack(padded, 1), torch.stack(logprobs, 1), atol=1e-6)


def _config(*flags: str) -> tuple[JobConfig, ParallelDims]:
    config = JobConfig.parse_args(["--job.config_file", "train_configs/grpo_arith.toml", *flags], world_size=2)
    t, e = config.training, config.experimental
    dims = ParallelDims.from_sections(training=t, experimental=e, world_size=2)
    return config, dims


@pytest.mark.parametrize(
    "flags, error, message",
    [
        (["--rl.group_size", "1"], ValueError, "rl.group_size = 1: advantages compare the completions of one prompt"),
        (
            [
                "--experimental.pipeline_parallel_degree",
                "2",
                "--training.data_parallel_shard_degree",
                "1",
                "--training.batch_size",
                "32",
            ],
            NotImplementedError,
            "experimental.pipeline_parallel_degree = 2: not built",
        ),
        (
            [
                "--experimental.context_parallel_degree",
                "2",
                "--training.data_parallel_shard_degree",
                "1",
                "--training.batch_size",
                "32",
            ],
            NotImplementedError,
            "experimental.context_parallel_degree = 2: not built",
        ),
        (["--rl.prompts_per_step", "3"], ValueError, "rl.prompts_per_step = 3 is not a multiple of the data-parallel"),
        (["--training.batch_size", "8"], ValueError, "= 16 per rank, and training.batch_size x"),
        (["--model.attn_mask_type", "block_causal"], NotImplementedError, "model.attn_mask_type = 'block_causal'"),
        (
            ["--rl.max_staleness", "1", "--rl.rollouts_path", "/tmp/r.jsonl"],
            ValueError,
            "an outside engine already generates the rollouts, and its staleness is its own",
        ),
        (["--rl.max_staleness", "2", "--rl.publish_every", "3"], ValueError, "so it is published every step"),
    ],
)
def test_refused_before_launch(flags, error, message):
    config, dims = _config(*flags)
    with pytest.raises(error) as e:
        check_rl(config, dims)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_algorithm_and_reward_refused():
    with pytest.raises(Exception, match="rl.algorithm"):
        _config("--rl.algorithm", "ppo")
    config, dims = _config("--rl.reward", "torchtitan.features.rl.rewards:exactly")
    with pytest.raises(ValueError, match="has no function 'exactly'"):
        check_rl_machine(config, dims)
    assert check_rl(*_config()) == [] and check_rl_machine(*_config()) == []


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--rl.temperature", "0"],
            "rl.temperature = 0 is greedy sampling: with rl.group_size = 4 every completion of a group is the same, so "
            "its rewards are equal, every advantage is 0 and nothing is learned; set rl.temperature > 0 (1.0 is usual)",
        ),
        (
            ["--rl.top_k", "1", "--rl.algorithm", "dapo", "--rl.rollouts_path", "rollouts.jsonl"],
            "rl.top_k = 1 is greedy sampling by the engine (with rl.rollouts_path these keys describe its sampling): "
            "with rl.group_size = 4 every completion of a group is the same, so its rewards are equal, every advantage "
            "is 0 and nothing is learned; set rl.top_k = 0 (every token) or > 1",
        ),
    ],
    ids=["temperature-0", "top_k-1-engine"],
)
def test_greedy_sampling_refused_by_the_preflight_command(flags, error, capsys):
    """``python -m torchtitan.preflight``'s entry, in process: greedy groups cannot learn, in either mode."""
    args = ["--world_size", "2", "--job.config_file", "train_configs/grpo_arith.toml"]
    assert preflight([*args, *flags]) == 2
    assert capsys.readouterr() == ("", f"error: {error}\n")
    assert preflight([*args, "--rl.top_k", "2", "--rl.temperature", "0.5"]) == 0


def test_a_negative_staleness_is_one_line(capsys):
    args = ["--world_size", "2", "--job.config_file", "train_configs/grpo_arith.toml", "--rl.max_staleness", "-1"]
    assert preflight(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert "rl.max_staleness" in err and "-1" in err and ">= 0" in err, err


def test_the_generator_uses_the_policy_exactly_k_steps_before():
    from torchtitan.features.rl.generator import policy_for

    assert [policy_for(s, 0, 1) for s in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [policy_for(s, 0, 2) for s in range(1, 6)] == [0, 0, 0, 1, 2]
    assert [policy_for(s, 4, 1) for s in range(5, 9)] == [4, 4, 5, 6]  # resumed at step 4: its policy first


def test_a_generator_that_dies_stops_the_step_at_once_with_its_log(tmp_path):
    """The trainer's wait for a step's rows ends as soon as the generator process has failed, with its exit and its
    log's last lines, instead of waiting out rl.rollouts_wait_seconds."""
    import subprocess
    import sys
    import time

    from torchtitan.features.rl.generator import LOG, Generator
    from torchtitan.features.rl.rollouts import RolloutFile

    with open(tmp_path / LOG, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; print('KeyError: model.tokenizer_path'); sys.exit(3)"], stdout=log
        )
    process.wait()
    rows = RolloutFile(str(tmp_path / "rollouts.jsonl"), run="abc", producer=Generator(process, str(tmp_path)).error)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        rows.take(1, 12, 600.0)
    assert time.monotonic() - start < 5
    assert str(e.value) == (
        "step 1: the rollout generator (rl.max_staleness) exited 3: KeyError: model.tokenizer_path "
        f"(its log: {tmp_path}/{LOG})"
    )
