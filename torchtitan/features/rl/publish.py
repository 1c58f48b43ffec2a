"""Publishing the policy for an outside rollout engine (vLLM, SGLang, or scripts/rl_engine.py): a Hugging Face
folder per published step, and a ``latest`` file naming the newest complete one.

    <publish_folder>/step-N/config.json, model.safetensors   (the family's HF names, fp32 or the run's dtype)
    <publish_folder>/latest                                   "step-N" and "run <id>", replaced (rename) after step-N
                                                              is written

An engine polls ``latest``, reloads the folder it names and writes the next steps' rollouts (rollouts.py has the
row format), each row naming the run whose policy made it (``"run": <id>``), to the file the trainer reads
(``rl.rollouts_path``). The run's id is drawn at its fresh start and kept by a resume (read back from ``latest``), so
a run never reads rows made from another run's policy (rollouts.py ``RolloutFile``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan.checkpointing.hf.files import save_hf_folder

logger = logging.getLogger(__name__)


LATEST = "latest"


def read_latest(root: str) -> tuple[int, str | None] | None:
    """(step, run id) of ``root/latest``, or None without one (a ``latest`` of before run ids: run None)."""
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return None
    step = int(lines[0].strip().removeprefix("step-"))
    runs = [line.split(" ", 1)[1].strip() for line in lines[1:] if line.startswith("run ")]
    return step, runs[0] if runs else None


def run_identity(root: str, *, resumed: bool) -> str:
    """This run's id (on the caller's rank: rank 0 draws it): a resumed run keeps the one its ``latest`` names, a
    fresh run draws a new one."""
    found = read_latest(root) if resumed else None
    return found[1] if found is not None and found[1] is not None else secrets.token_hex(6)


def publish_policy(model: nn.Module, core: Any, root: str, step: int, run: str) -> str:
    """Write ``model`` (gathered from every rank) as ``root/step-<step>`` on rank 0 and name it, with the run's id
    ``run``, in ``root/latest``; returns the folder.

    Raises:
        NotImplementedError: the family has no Hugging Face adapter.
    """
    adapter = core.spec.state_dict_adapter
    if adapter is None:
        raise NotImplementedError(f"rl.publish_every: model family {core.spec.name} has no Hugging Face adapter")
    start = time.perf_counter()
    # every rank takes part in the gather; rank 0 keeps the full tensors, on the CPU
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    folder = os.path.join(root, f"step-{step}")
    if core.rank == 0:
        args = dataclasses.asdict(core.model_args)
        dtype = next(iter(weights.values())).dtype
        hf = {k: v.to(dtype) for k, v in adapter.to_hf_state_dict(weights, args).items()}
        save_hf_folder(hf, adapter.hf_config(args, weights, dtype=dtype), folder)
        tmp = os.path.join(root, f".latest.{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"step-{step}\nrun {run}\n")
        os.replace(tmp, os.path.join(root, LATEST))
        logger.info("published the policy of step %d to %s in %.2f s", step, folder, time.perf_counter() - start)
    if dist.is_initialized():
        dist.barrier()
    return folder
