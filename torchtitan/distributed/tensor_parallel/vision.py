"""Tensor parallel for an image model (``qwen3_5_vl``): the language model's plan as a text model's, the vision tower
replicated.

The tower is small beside the language model (the published 9B's: 0.4B of 9.4B) and its patches are few, so every
TP rank runs all of it: each of its modules with parameters holds them as Replicate DTensors (so every parameter of
the model is a DTensor on the TP mesh: the optimizer's foreach step and the gradient norm see no mix) and takes and
returns plain tensors, identical on every rank. The embedding then leaves the sequence whole (Replicate), the image
features take the pads' places (``place_images``), and only then is the sequence split for sequence parallel
(Replicate -> Shard(1): each rank keeps its slice, no communication; in backward the slices' gradients are gathered,
so the tower's gradients are the same on every rank).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleOutput, RowwiseParallel

from torchtitan.distributed.tensor_parallel.replicated import inputs_replicated, outputs_local, replicate_own


def embedding_plan() -> dict[str, ParallelStyle]:
    """The top-level entries that differ from a text model's: the embedding whole, the sequence split after the
    images are placed."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "place_images": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    }


def replicate_tower(tower: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Every module of ``tower`` with parameters of its own: Replicate DTensors, plain tensors in and out. The
    learned position table is read as a tensor, not called: the tower reads it through ``local_part``."""
    for module in list(tower.modules()):
        if any(True for _ in module.parameters(recurse=False)):
            if module is tower.pos_embed:
                replicate_own("pos_embed", module, tp_mesh)
                continue
            distribute_module(module, tp_mesh, replicate_own, inputs_replicated, outputs_local)
