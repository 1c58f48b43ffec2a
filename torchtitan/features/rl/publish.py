"""Publishing the policy for an outside rollout engine (vLLM, SGLang, or scripts/rl_engine.py): a Hugging Face
folder per published step, and a ``latest`` file naming the newest complete one.

    <publish_folder>/step-N/config.json, model.safetensors   (the family's HF names, fp32 or the run's dtype)
    <publish_folder>/latest                                   "step-N", replaced (rename) after step-N is written

An engine polls ``latest``, reloads the folder it names and writes the next steps' rollouts (rollouts.py has the
row format) to the file the trainer reads (``rl.rollouts_path``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchtitan.checkpointing.hf.files import save_hf_folder

logger = logging.getLogger(__name__)


def publish_policy(model: nn.Module, core: Any, root: str, step: int) -> str:
    """Write ``model`` (gathered from every rank) as ``root/step-<step>`` on rank 0; returns the folder.

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
            f.write(f"step-{step}\n")
        os.replace(tmp, os.path.join(root, "latest"))
        logger.info("published the policy of step %d to %s in %.2f s", step, folder, time.perf_counter() - start)
    if dist.is_initialized():
        dist.barrier()
    return folder
