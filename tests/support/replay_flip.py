"""The step replay's fault injection for the tests: one flipped bit in one rank's gradient on a replay's second pass.

``flip_bit`` is a ``features.replay.replay.AfterPass``; ``builders`` gives the trainer a replay with it (the product's
seam, ``Builders.overrides['step_pass']``). ``python -m torchtitan.launch ... -m tests.support.replay_flip RANK STEP --job.config_file
FILE [--section.key value ...]`` runs ``torchtitan.train.main`` with it, for the exit code and the launcher's line.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

# The tensor whose gradient is flipped (every llama-style family has it) and the element: a low mantissa bit,
# so that a run going on with it ('warn') stays finite.
TENSOR, BIT = "tok_embeddings.weight", 3


def flip_bit(step: int, pass_number: int, params, *, rank: int, at_step: int) -> None:
    here = dist.get_rank() if dist.is_initialized() else 0
    if (here, step, pass_number) != (rank, at_step, 2):
        return
    grad = dict(params)[TENSOR].grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    with torch.no_grad():
        local.view(torch.int32).view(-1)[0] ^= 1 << BIT


def builders(rank: int, step: int):
    from torchtitan.engine.builders import Builders
    from torchtitan.features.replay.replay import build_step_replay

    after_pass = functools.partial(flip_bit, rank=rank, at_step=step)
    return Builders(overrides={"step_pass": functools.partial(build_step_replay, after_pass=after_pass)})


def main(argv: list[str]) -> int:
    from torchtitan.train import main as train_main

    return train_main(argv[2:], builders=builders(int(argv[0]), int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
