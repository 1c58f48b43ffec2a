"""An outside rollout engine, played by our own generator: what vLLM or SGLang does for an RL run (docs/rl.md).

Reads the trainer's flags (after ``--``), then for each step: waits until the trainer has published a policy new
enough (``<publish_folder>/latest`` names ``step-K`` with K >= step - 1 - lag), reloads that Hugging Face folder,
generates the step's groups (the trainer's prompts and seeds: rl/prompts.py, rl/rollouts.py), scores them with
``rl.reward`` and appends the step's rows to ``rl.rollouts_path`` in one write. The trainer, run with the same flags,
reads them (``rl.rollouts_wait_seconds``) and publishes the next policy (``rl.publish_every``).

    python scripts/rl_engine.py --steps 20 [--lag 0] [--timeout 600] -- --job.config_file train_configs/grpo_arith.toml \\
        --rl.rollouts_path /tmp/rollouts.jsonl --rl.rollouts_wait_seconds 600 --rl.publish_every 1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from torchtitan.components.generation import Sampling  # noqa: E402
from torchtitan.config.manager import JobConfig  # noqa: E402
from torchtitan.datasets.sft.chat_template import ChatTokenizer  # noqa: E402
from torchtitan.features.rl.prompts import PromptSource  # noqa: E402
from torchtitan.features.rl.rewards import load_reward  # noqa: E402
from torchtitan.features.rl.rollouts import Rollout, generate_group, group_seed, score_completion  # noqa: E402


def _load_model_fn():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.py")
    spec = importlib.util.spec_from_file_location("generate_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_model


def wait_for_policy(root: str, at_least: int, timeout: float) -> int:
    """The step of the newest published policy once it is >= ``at_least``."""
    deadline = time.monotonic() + timeout
    latest = os.path.join(root, "latest")
    while True:
        if os.path.isfile(latest):
            step = int(open(latest).read().strip().removeprefix("step-"))
            if step >= at_least:
                return step
        if time.monotonic() > deadline:
            sys.exit(f"rl_engine: no policy of step >= {at_least} in {root} after {timeout:g} s")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, required=True, help="steps to write rollouts for, from 1")
    p.add_argument("--lag", type=int, default=0, help="policy staleness allowed: step s uses a policy >= s - 1 - lag")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each policy")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the trainer's flags")
    args = p.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    config = JobConfig.parse_args(flags, world_size=1)
    rl, t = config.rl, config.training
    if not rl.rollouts_path:
        sys.exit("rl_engine: the trainer's flags set no rl.rollouts_path (where the engine writes)")
    tokenizer = ChatTokenizer(config.model.tokenizer_path)
    prompts = PromptSource.of_run(rl, t, tokenizer)
    reward = load_reward(rl.reward)
    stop_ids = tuple(rl.stop_ids) or prompts.stop_ids
    sampling = Sampling(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p)
    root = rl.publish_folder or os.path.join(config.job.dump_folder, "policy")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load_model, loaded, model = _load_model_fn(), None, None
    for step in range(1, args.steps + 1):
        policy = wait_for_policy(root, step - 1 - args.lag, args.timeout)
        if policy != loaded:
            model = load_model(None, os.path.join(root, f"step-{policy}"), t.seq_len, tokenizer.base.n_words, device)
            loaded = policy
        rows = []
        for position, prompt in enumerate(prompts.sample(step)):
            completions = generate_group(
                model,
                prompt,
                group_size=rl.group_size,
                sampling=sampling,
                max_new_tokens=rl.max_new_tokens,
                stop_ids=stop_ids,
                seed=group_seed(t.seed, step, 0, position),
                device=device,
            )
            for ids, logprobs in completions:
                value = score_completion(reward, rl.reward, prompts, prompt, ids, stop_ids)
                rows.append(Rollout(step, position, prompt.index, prompt.ids, ids, logprobs, value).record())
        with open(rl.rollouts_path, "a", encoding="utf-8") as f:  # the step's rows in one write
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        print(f"rl_engine: step {step}: {len(rows)} rollouts from policy step-{policy}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
