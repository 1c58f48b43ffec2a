"""The ``[rl]`` section of the config tree (torchtitan/config/schema.py holds the tree; docs/rl.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.fields import POSITIVE
from torchtitan.config.fields import config_field as _f


@dataclass
class Rl:
    enable: bool = _f(
        False,
        "reinforcement learning instead of pre-training/fine-tuning: each step samples prompts, generates "
        "completions with the current policy, scores them with rl.reward and updates the policy (docs/rl.md)",
    )
    algorithm: Literal["grpo", "dapo"] = _f(
        "grpo",
        "'grpo': group-normalized advantages, a symmetric clipped ratio, each completion's tokens averaged (with "
        "rl.std_normalize = false: Dr. GRPO's unscaled advantages); 'dapo': clip-low/clip-high decoupled, every token "
        "of the step weighted alike, groups whose rewards are all equal dropped and the batch refilled",
    )
    prompts_path: str = _f(
        "",
        "JSONL of prompts: chat rows ('messages', the last a user turn; rendered with the tokenizer's chat template) or "
        "'prompt' rows; every field of a row reaches the reward (e.g. 'answer')",
    )
    prompts_per_step: int = _f(8, "prompts sampled per step (a multiple of the data-parallel degree)", bound=POSITIVE)
    group_size: int = _f(4, "completions generated per prompt (at least 2: advantages compare them)", bound=POSITIVE)
    updates_per_step: int = _f(
        1, "optimizer updates per step: the step's completions split into this many mini-batches", bound=POSITIVE
    )
    max_new_tokens: int = _f(
        16, "generation budget per completion (prompt + budget <= training.seq_len)", bound=POSITIVE
    )
    temperature: float = _f(
        1.0,
        "sampling temperature; log-probs are of logits / temperature (with rollouts_path: the engine's sampling "
        "temperature). 0 (greedy) is refused: a group's completions would all be the same, so nothing is learned",
        bound=Bound(ge=0),
    )
    top_p: float = _f(1.0, "nucleus sampling: the best tokens up to this probability mass", bound=Bound(gt=0))
    top_k: int = _f(
        0, "sample among the k best tokens (0: all; 1, greedy, is refused as temperature 0 is)", bound=Bound(ge=0)
    )
    stop_ids: list[int] = _f([], "token ids that end a completion (default: the chat template's end of turn and eos)")
    reward: str = _f(
        "torchtitan.features.rl.rewards:exact_match",
        "'module:function' called as function(prompt=..., completion=..., row=...) -> float per completion; shipped "
        "(torchtitan.features.rl.rewards): exact_match, number_match, format_reward, arith (format + number)",
    )
    environment: str = _f(
        "",
        "multi-turn episodes: 'module:Class' of an environment (reset(row), step(turn) -> EnvStep(reply, reward)) that "
        "answers each model turn, its reply appended as a user turn, until it replies None; its tokens are out of the "
        "loss and the episode's reward is its environment's (rl.reward is not called). Shipped: "
        "torchtitan.features.rl.environments.calculator:CalculatorEnvironment ('' : one turn, scored by rl.reward)",
    )
    max_turns: int = _f(
        4,
        "with rl.environment: model turns per episode at most (the episode also ends where rl.max_new_tokens, its "
        "whole window, runs out)",
        bound=POSITIVE,
    )
    importance_cap: float = _f(
        0.0,
        "truncated importance sampling (TIS): the ratio is taken to the trainer's own log-probs at the step's start, "
        "and each token weighted by min(exp(trainer - generator log-prob), this cap), for a generator whose log-probs "
        "differ from the trainer's (an outside engine, stale rollouts); 0: off (the ratio is to the generator's)",
        bound=Bound(ge=0),
    )
    correct_reward: float = _f(1.0, "a completion counts as correct (the logged accuracy) at a reward >= this")
    std_normalize: bool = _f(True, "divide each group's advantages by its reward std (false: Dr. GRPO)")
    clip_low: float = _f(0.2, "the ratio is clipped below at 1 - clip_low", bound=Bound(gt=0))
    clip_high: float = _f(
        0.2, "the ratio is clipped above at 1 + clip_high (DAPO's clip-higher: e.g. 0.28)", bound=Bound(gt=0)
    )
    kl_coef: float = _f(
        0.0,
        "weight of the k3 KL estimate to a frozen reference (the policy at the run's start); 0: no reference",
        bound=Bound(ge=0),
    )
    max_sampling_rounds: int = _f(
        3,
        "dapo: rounds of fresh prompts generated to refill the groups dropped for equal rewards (then the step trains "
        "on what it has, the dropped groups contributing nothing)",
        bound=POSITIVE,
    )
    rollouts_path: str = _f(
        "",
        "read each step's completions from this JSONL (an outside engine's: step, prompt_ids, completion_ids, logprobs, "
        "reward; docs/rl.md) instead of generating them",
    )
    rollouts_wait_seconds: float = _f(
        0.0,
        "with rollouts_path: wait up to this long for a step's rows to appear (0: they must be there)",
        bound=Bound(ge=0),
    )
    max_nonfinite_logprob_share: float = _f(
        0.01,
        "a completion token whose generator log-prob is not finite (NaN, inf; an engine's null) is left out of the "
        "loss and of its token counts, and counted (nonfinite_logprob_tokens); a step where more than this share of "
        "its completion tokens are such stops the run before its update (1: never stop)",
        bound=Bound(ge=0),
    )
    publish_every: int = _f(
        0,
        "every N steps (and at the start) write the policy as a Hugging Face folder for an outside engine to reload: "
        "<publish_folder>/step-N, then <publish_folder>/latest naming it; 0: never",
        bound=Bound(ge=0),
    )
    publish_folder: str = _f("", "where the policy is published (default <dump_folder>/policy)")
    max_staleness: int = _f(
        0,
        "asynchronous rollouts: a generator process (rank 0's child) makes step s's completions from the policy "
        "published after step max(start, s - 1 - max_staleness), overlapping the updates of the steps between; the "
        "policy is published every step; the trainer waits for a step's rows up to rl.rollouts_wait_seconds (0: 1800 s); "
        "0: generated in process right before each update",
        bound=Bound(ge=0),
    )

    def generates_in_process(self) -> bool:
        """The ranks generate each step's rollouts themselves (not an outside engine, not the asynchronous generator)."""
        return not self.rollouts_path and self.max_staleness == 0

    def run_records(self) -> list[str]:
        """What an RL run writes in its dump folder besides the common records: its rollouts and, when published
        there, its policy folders; a new run sets an earlier run's aside (launch/run_folder.py)."""
        if not self.enable:
            return []
        return ["rollouts.jsonl", "generator", *([] if self.publish_folder else ["policy"])]
