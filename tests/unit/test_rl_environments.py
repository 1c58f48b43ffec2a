"""RL's multi-turn environments in process: the calculator's parser and replies, the loader's one-line errors, an
episode steered through ``generate`` (the environment's tokens forced, marked and out of the loss), the window and
the errors of an episode; and truncated importance sampling (rl.importance_cap)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtitan.components.generation import Sampling
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.features.rl.environments import EnvStep, load_environment
from torchtitan.features.rl.environments.calculator import CalcError, CalculatorEnvironment, evaluate
from torchtitan.features.rl.environments.episodes import episode_spec, generate_episodes
from torchtitan.features.rl.losses import Clip, policy_loss, token_weights
from torchtitan.features.rl.prompts import PromptSource
from torchtitan.features.rl.records import step_records
from torchtitan.features.rl.rollouts import Rollout, update_batch
from torchtitan.models.common.documents import IGNORE_INDEX

CALCULATOR = "torchtitan.features.rl.environments.calculator:CalculatorEnvironment"
HERE = "tests.unit.test_rl_environments"


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*7", 84),
        ("3+4*2", 11),
        ("(3+4)*2", 14),
        ("-3 + 10", 7),
        ("20/4-1", 4),
        ("2*(3-(1+1))", 2),
        (" 19 + 19 ", 38),
    ],
)
def test_the_calculator_parses_integer_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os')", "unexpected '_'"),
        ("7/2", "7/2 is not a whole number"),
        ("1/0", "1/0 is not a whole number"),
        ("(1+2", "a '(' is not closed"),
        ("1+", "the expression ends early"),
        ("1.5+1", "unexpected '.'"),
        ("9999999*9999999", "a value beyond"),
    ],
)
def test_the_calculator_refuses_what_is_not_integer_arithmetic(expression, message):
    with pytest.raises(CalcError, match=message.replace("(", r"\(").replace("*", r"\*")):
        evaluate(expression)


def test_the_calculator_replies_to_a_call_and_scores_the_final_turn():
    env = CalculatorEnvironment()
    env.reset({"answer": "3 plus 14 is 17."})
    assert env.step("<calc>3+14</calc>") == EnvStep("<result>17</result>", 0.0)
    assert env.step("<calc>3/0</calc>") == EnvStep("<result>error: 3/0 is not a whole number</result>", 0.0)
    assert env.step("3 plus 14 is 17.") == EnvStep(None, 1.0)
    assert env.step("3 plus 14 is 18.") == EnvStep(None, 0.0)


def test_the_shaped_calculator_credits_the_first_right_call_once():
    from torchtitan.features.rl.environments.calculator import ShapedCalculatorEnvironment

    env = ShapedCalculatorEnvironment()
    env.reset({"answer": "3 plus 14 is 17."})
    assert env.step("<calc>4+14</calc>") == EnvStep("<result>18</result>", 0.0)  # operands copied wrong
    assert env.step("<calc>3/0</calc>").reward == 0.0
    assert env.step("<calc>3+14</calc>") == EnvStep("<result>17</result>", 0.5)
    assert env.step("<calc>14+3</calc>") == EnvStep("<result>17</result>", 0.0)  # once an episode
    assert env.step("3 plus 14 is 17.") == EnvStep(None, 1.0)
    env.reset({"answer": "3 plus 14 is 17."})  # a new episode is credited again
    assert env.step("<calc>3+14</calc>").reward == 0.5 and env.step("3 plus 14 is 18.").reward == 0.0


class Raises:
    def __init__(self):
        raise RuntimeError("no calculator here")


class NoStep:
    def reset(self, row):
        pass


@pytest.mark.parametrize(
    "spec, message",
    [
        ("calculator", "rl.environment = 'calculator': expected 'module:Class'"),
        ("no_such_module:Env", "module 'no_such_module' cannot be imported"),
        ("torchtitan.features.rl.environments:Calculator", "has no class 'Calculator' (it has: EnvStep, Environment)"),
        (f"{HERE}:Raises", "Raises() raised RuntimeError: no calculator here; an environment is built with no"),
        (f"{HERE}:NoStep", "NoStep has no reset(row) and step(turn) methods"),
    ],
)
def test_an_environment_that_does_not_load_is_one_line(spec, message):
    with pytest.raises(ValueError) as e:
        load_environment(spec)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert load_environment(CALCULATOR) is CalculatorEnvironment


# -- an episode through generate, with a scripted policy --------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts() -> PromptSource:
    tokenizer = ChatTokenizer("tests/assets/sft/tokenizer")
    return PromptSource(
        "tests/assets/rl/arith_prompts.jsonl",
        tokenizer,
        seed=0,
        per_step=1,
        group_size=2,
        max_new_tokens=64,
        seq_len=96,
    )


class Scripted(nn.Module):
    """A 'policy' that writes ``call`` and, once an environment's reply has ended (its last token seen), ``answer``:
    a one-hot logit on the next token of its script, read from every token it has been fed (the KV cache feeds the
    new ones only). No attention layers: the cache has nothing to install."""

    def __init__(self, call: list[int], answer: list[int], reply_end: list[int], vocab: int):
        super().__init__()
        self.call, self.answer, self.reply_end, self.vocab = call, answer, reply_end, vocab
        self.layers = nn.ModuleDict()
        self.fed: list[list[int]] | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions[0] == 0:
            self.fed, self.prompt_len = [[] for _ in range(tokens.shape[0])], tokens.shape[1]
        logits = torch.full((*tokens.shape, self.vocab), -30.0)  # (bs, n, vocab)
        for row, ids in enumerate(tokens.tolist()):
            self.fed[row] += ids
            seen = self.fed[row][self.prompt_len :]
            cut = [i for i in range(len(seen)) if seen[i - len(self.reply_end) + 1 : i + 1] == self.reply_end]
            script, done = (self.answer, seen[cut[-1] + 1 :]) if cut else (self.call, seen)
            logits[row, -1, script[min(len(done), len(script) - 1)]] = 30.0
        return logits


def _episode(prompts, *, environment=CALCULATOR, max_new_tokens=64, max_turns=4, group_size=2):
    prompt = prompts.prompts[5]  # "What is 0 plus 6?"
    tok = prompts.tokenizer
    rl = SimpleNamespace(environment=environment, max_new_tokens=max_new_tokens, max_turns=max_turns)
    spec = episode_spec(rl, prompts, prompts.stop_ids)
    model = Scripted(
        tok.encode_chat("<calc>0+6</calc><|im_end|>")[0],
        tok.encode_chat(prompt.row["answer"] + "<|im_end|>")[0],
        tok.encode_chat("<|im_start|>assistant\n")[0],
        tok.base.n_words,
    )
    return prompt, generate_episodes(
        model, prompt, spec, group_size=group_size, sampling=Sampling(temperature=1.0), seed=0, device="cpu", where="w"
    )


def test_an_episode_calls_the_calculator_and_its_tokens_are_out_of_the_loss(prompts):
    prompt, (episodes, error) = _episode(prompts)
    assert error is None and len(episodes) == 2
    e = episodes[0]
    text = prompts.tokenizer.base.model.decode(e.ids, skip_special_tokens=False)
    assert text == (
        "<calc>0+6</calc><|im_end|>\n<|im_start|>user\n<result>6</result><|im_end|>\n<|im_start|>assistant\n"
        "0 plus 6 is 6.<|im_end|>"
    )
    reply = prompts.tokenizer.encode_chat("\n<|im_start|>user\n<result>6</result><|im_end|>\n<|im_start|>assistant\n")
    call = len(prompts.tokenizer.encode_chat("<calc>0+6</calc><|im_end|>")[0])
    assert e.env_mask == [0] * call + [1] * len(reply[0]) + [0] * (len(e.ids) - call - len(reply[0]))
    assert e.reward == 1.0 and all(lp == 0.0 for lp, m in zip(e.logprobs, e.env_mask) if m)
    # the update: the environment's tokens have no label, so no weight, no count and no ratio
    row = Rollout(1, 0, prompt.index, prompt.ids, e.ids, e.logprobs, e.reward, env_mask=e.env_mask)
    batch = update_batch([row], [1.0], 96, pad_id=0)
    p = len(prompt.ids)
    labels = batch.labels[0, p - 1 : p - 1 + len(e.ids)]
    env = torch.tensor(e.env_mask, dtype=torch.bool)
    assert (labels[env] == IGNORE_INDEX).all() and (labels[~env] != IGNORE_INDEX).all()
    weights = token_weights(batch.mask, algorithm="dapo")
    assert int(batch.mask.sum()) == row.model_tokens == len(e.ids) - len(reply[0])
    assert weights[0, p - 1 : p - 1 + len(e.ids)][env].sum() == 0
    rl = SimpleNamespace(correct_reward=1.0, max_staleness=0, generates_in_process=lambda: True)
    assert step_records(rl, 1, [row, row], 0, 1.0, 1.0, 1.0)["completion_length"] == row.model_tokens
    assert "env_mask" in row.record() and "env_mask" not in Rollout(1, 0, 0, [1], [2], [0.0], 0.0).record()


def test_an_episode_ends_at_its_turn_limit_and_its_window(prompts):
    _, (episodes, error) = _episode(prompts, max_turns=1)  # the call was the last turn: no reply, reward 0
    assert error is None and episodes[0].reward == 0.0 and not any(episodes[0].env_mask)
    _, (episodes, error) = _episode(prompts, max_new_tokens=30)  # the call (10) + the reply (28) do not fit
    assert error is None and episodes[0].reward == 0.0 and not any(episodes[0].env_mask)


class LongReply:
    def reset(self, row):
        pass

    def step(self, turn):
        return EnvStep("9" * 200)


class StepRaises(LongReply):
    def step(self, turn):
        raise KeyError("the tool is down")


class BadReward(LongReply):
    def step(self, turn):
        return EnvStep(None, float("nan"))


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            f"{HERE}:LongReply",
            f"rl.environment {HERE}:LongReply: its reply on w is 209 tokens, more than the episode's whole window "
            "rl.max_new_tokens = 64 (reply '999",
        ),
        (f"{HERE}:StepRaises", f"rl.environment {HERE}:StepRaises raised KeyError: 'the tool is down' on w (the model"),
        (f"{HERE}:BadReward", f"rl.environment {HERE}:BadReward returned the reward nan on w (the model's turn"),
    ],
)
def test_an_episode_that_fails_is_one_line_after_generation(prompts, environment, message):
    _, (episodes, error) = _episode(prompts, environment=environment)
    assert len(episodes) == 2 and message in error and "\n" not in error, error


def test_the_importance_cap_weights_tokens_and_is_off_by_default():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -3.0, -0.5]])  # the generator's: the second token is 1 nat less likely there
    adv, weights, clip = torch.tensor([1.0]), torch.full((1, 3), 1 / 3), Clip(0.2, 0.2)
    plain, stats = policy_loss(logprobs, old, adv, weights, clip)
    assert "importance_capped" not in stats
    same, _ = policy_loss(logprobs, old, adv, weights, clip, proximal_logprobs=old, importance_cap=2.0)
    assert torch.equal(same, plain), "the trainer's log-probs equal to the generator's: the loss without the cap"
    proximal = logprobs.detach()  # the trainer's at the step's start: ratio 1, weight exp(1) capped at 2
    capped, stats = policy_loss(logprobs, old, adv, weights, clip, proximal_logprobs=proximal, importance_cap=2.0)
    assert torch.allclose(capped, torch.tensor(-(1 + 2 + 1) / 3))
    assert torch.allclose(stats["importance_capped"], torch.tensor(1 / 3))
    capped.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 3, -2 / 3, -1 / 3]]))


def test_the_asynchronous_generator_runs_the_same_episodes(prompts):
    """rollouts.generate_step (the generator process's) goes through the one episode loop: a step's rows carry the
    environment's tokens marked, as the ranks' rows do."""
    from torchtitan.features.rl.rollouts import generate_step

    tok = prompts.tokenizer
    rl = SimpleNamespace(environment=CALCULATOR, max_new_tokens=64, max_turns=4, group_size=2, reward="unused")
    model = Scripted(
        tok.encode_chat("<calc>2+2</calc><|im_end|>")[0],
        tok.encode_chat("2 plus 2 is 4.<|im_end|>")[0],
        tok.encode_chat("<|im_start|>assistant\n")[0],
        tok.base.n_words,
    )
    kwargs = dict(rl=rl, seed=0, reward_fn=None, stop_ids=prompts.stop_ids, sampling=Sampling(1.0), device="cpu")
    rows = generate_step(model, prompts, 1, episodes=episode_spec(rl, prompts, prompts.stop_ids), **kwargs)
    reply = tok.encode_chat("\n<|im_start|>user\n<result>4</result><|im_end|>\n<|im_start|>assistant\n")[0]
    assert len(rows) == 2 and all(sum(r.env_mask) == len(reply) and r.env_mask[0] == 0 for r in rows), rows
    assert "<result>4</result>" in tok.base.model.decode(rows[0].completion_ids, skip_special_tokens=False)


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ["--rl.environment", "torchtitan.features.rl.environments.calculator:Calc"],
            "rl.environment = 'torchtitan.features.rl.environments.calculator:Calc': "
            "torchtitan.features.rl.environments.calculator has no class 'Calc' (it has: CalcError, CalculatorEnvironment, ShapedCalculatorEnvironment)",
        ),
        (
            ["--rl.rollouts_path", "/tmp/r.jsonl"],
            f"rl.environment = '{CALCULATOR.replace(':', ':Shaped')}' with rl.rollouts_path = '/tmp/r.jsonl': an outside engine generates the "
            "rollouts, so it runs the episodes (its rows' env_mask marks the environment's tokens); unset one",
        ),
    ],
    ids=["no-such-class", "with-an-engine"],
)
def test_the_preflight_command_refuses_in_one_line(flags, error, capsys):
    from torchtitan.preflight.__main__ import main as preflight

    args = ["--world_size", "2", "--job.config_file", "train_configs/grpo_calc.toml"]
    assert preflight([*args, *flags]) == 2
    assert capsys.readouterr() == ("", f"error: {error}\n")
    assert preflight(args) == 0
