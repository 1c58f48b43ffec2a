"""``local_part``: this rank's part of a parameter a parallelism sharded as a DTensor (expert parallel's experts,
tensor parallel's per-head parameters: attention sinks, Gated DeltaNet's ``A_log``), a plain tensor as it is.

Duck-typed, so models/ imports nothing distributed; ``to_local()`` (not distributed.backend.dtensor.local_shard)
because it is differentiable: the gradient reaches the sharded parameter.
"""

from __future__ import annotations

import torch


def local_part(weight: torch.Tensor) -> torch.Tensor:
    # The type's attribute, not the tensor's: dynamo answers hasattr on a traced DTensor with False (a TP-sharded
    # sink then met the local scores in the compiled graph: "got mixed torch.Tensor and DTensor").
    return weight.to_local() if hasattr(type(weight), "to_local") else weight
