"""Asynchronous rollouts (``rl.max_staleness`` = k > 0): the run's generator, a process of its own beside the ranks.

Rank 0 starts it once the run has published its starting policy (``start_generator``). For each step s it waits for
the policy published after step ``policy_for(s)`` = max(start, s - 1 - k) (the trainer publishes every step), loads
that Hugging Face folder, generates and scores the step's groups with the trainer's prompts and seeds, and appends
the step's rows, each naming the policy step it came from and the seconds its generation took, to
``<run folder>/generator/rollouts.jsonl`` (one write). The trainer takes them as it takes an outside engine's
(rollouts.py ``RolloutFile``): generation of step s overlaps the updates of steps s - k .. s - 1.

The policy of step s is that exact step's (not the newest): the run is a function of its seed and k, so a run
with k = 1 gives the same numbers every time, and resumes as it ran. It ends after the run's last step, when the
trainer's process is gone, or on an error (written to ``generator/generator.log``, which the trainer shows).

    python -m torchtitan.features.rl.generator --config C --run ID --first_step S --steps N --parent PID
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig

FOLDER = "generator"
ROWS, LOG, CONFIG = "rollouts.jsonl", "generator.log", "config.toml"


def policy_for(step: int, start: int, staleness: int) -> int:
    """The published step whose policy generates step ``step``'s rollouts (``start``: the run's first published)."""
    return max(start, step - 1 - staleness)


class Generator:
    """Rank 0's handle on the generator process: ``error()`` says why it stopped early, ``close()`` ends it."""

    def __init__(self, process: subprocess.Popen, folder: str):
        self.process, self.folder = process, folder

    def error(self) -> str | None:
        """None while it runs or after it finished cleanly; else its exit and its log's last lines."""
        code = self.process.poll()
        if code is None or code == 0:
            return None
        with open(os.path.join(self.folder, LOG), encoding="utf-8", errors="replace") as f:
            tail = "".join(f.readlines()[-8:]).strip()
        return f"the rollout generator (rl.max_staleness) exited {code}: {tail} (its log: {self.folder}/{LOG})"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_generator(config: JobConfig, run_folder: str, *, run: str, first_step: int) -> Generator:
    """Start the generator for steps ``first_step`` .. training.steps of run ``run`` (its config written beside its
    rows and log in ``<run_folder>/generator/``)."""
    folder = os.path.join(run_folder, FOLDER)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG), "w", encoding="utf-8") as f:
        f.write(config.to_toml())
    command = [
        sys.executable,
        "-m",
        "torchtitan.features.rl.generator",
        *("--config", os.path.join(folder, CONFIG), "--run", run, "--first_step", str(first_step)),
        *("--steps", str(config.training.steps), "--parent", str(os.getpid())),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one process of its own, not a rank of the run
    with open(os.path.join(folder, LOG), "a", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
    return Generator(process, folder)


def _wait_for(root: str, step: int, run: str, parent: int) -> None:
    """Until ``root/latest`` names run ``run`` at step >= ``step``; exits with the trainer (its process gone)."""
    from torchtitan.features.rl.publish import read_latest

    while True:
        found = read_latest(root)
        if found is not None and found[1] == run and found[0] >= step:
            return
        if os.getppid() != parent:
            sys.exit(0)  # the trainer is gone: nothing will read the rows
        time.sleep(0.05)


def _load_policy(config: JobConfig, folder: str, device):
    """The family's model from a published folder, in eval mode (the whole vocabulary, as the trainer samples)."""
    from torchtitan.checkpointing.hf.files import load_hf_weights
    from torchtitan.spec import get_model_spec

    spec = get_model_spec(config.model.name)
    fields, weights = load_hf_weights(folder, spec.state_dict_adapter)
    model_args = type(next(iter(spec.flavors.values()))).from_dict({**fields, "max_seq_len": config.training.seq_len})
    import torch

    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device=device)
    model.init_buffers(device)
    model.load_state_dict(weights)
    return model.eval()


def serve(config: JobConfig, out: str, *, run: str, first_step: int, steps: int, parent: int) -> None:
    """Append steps ``first_step`` .. ``steps``' rows to ``out``."""
    import torch

    from torchtitan.components.generation import Sampling
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.distributed.backend.device import get_device_info
    from torchtitan.features.rl.environments.episodes import episode_spec
    from torchtitan.features.rl.prompts import PromptSource
    from torchtitan.features.rl.rewards import load_reward
    from torchtitan.features.rl.rollouts import generate_step

    rl, t = config.rl, config.training
    torch.manual_seed(t.seed)
    tokenizer = ChatTokenizer(config.model.tokenizer_path)
    prompts = PromptSource.of_run(rl, t, tokenizer)
    stop_ids = tuple(rl.stop_ids) or prompts.stop_ids
    reward = None if rl.environment else load_reward(rl.reward)
    episodes = episode_spec(rl, prompts, stop_ids)
    sampling = Sampling(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p)
    root = rl.publish_folder or os.path.join(config.job.dump_folder, "policy")
    device = get_device_info(0).device  # the run's device choice, as rank 0's

    loaded, model = None, None
    for step in range(first_step, steps + 1):
        policy = policy_for(step, first_step - 1, rl.max_staleness)
        _wait_for(root, policy, run, parent)
        if policy != loaded:
            model, loaded = _load_policy(config, os.path.join(root, f"step-{policy}"), device), policy
        start = time.perf_counter()
        rows = generate_step(
            model,
            prompts,
            step,
            rl=rl,
            seed=t.seed,
            reward_fn=reward,
            episodes=episodes,
            stop_ids=stop_ids,
            sampling=sampling,
            device=device,
        )
        seconds = time.perf_counter() - start
        rows = [dataclasses.replace(row, policy_step=policy, generation_s=seconds) for row in rows]
        with open(out, "a", encoding="utf-8") as f:  # the step's rows in one write
            f.write("".join(json.dumps(row.record(run)) + "\n" for row in rows))
        print(f"generator: step {step}: {len(rows)} rollouts from policy step-{policy} in {seconds:.2f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the run's resolved config (TOML)")
    p.add_argument("--run", required=True, help="the run's id (the policy folder's latest names it)")
    p.add_argument("--first_step", type=int, required=True)
    p.add_argument("--steps", type=int, required=True, help="the run's last step")
    p.add_argument("--parent", type=int, required=True, help="the trainer's process: the generator ends with it")
    args = p.parse_args(argv)
    from torchtitan.config.manager import JobConfig

    config = JobConfig.parse_args(["--job.config_file", args.config])
    out = os.path.join(os.path.dirname(os.path.abspath(args.config)), ROWS)
    serve(config, out, run=args.run, first_step=args.first_step, steps=args.steps, parent=args.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
