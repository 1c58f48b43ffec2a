"""Fault tolerance in the memory estimate and the planner: what the replica groups add to one rank's memory and step.

The estimate covers one replica group (its ranks are the world the config describes); the groups add:

* synchronous mode: gradients are averaged across the groups in flat buckets of at most 32 MiB, one at a
  time (fault_tolerance/replicas.py). ``EstimatedReplicas`` runs that same bucket code in the fake step, with
  no collective, so the tracker sees the bucket where the real run holds it. The cross-group process group
  holds nothing else on the device (gloo reduces in place on CPU tensors).
* semi-synchronous modes, modeled (torchft's own code needs a lighthouse): at each synchronization, after the
  optimizer step with the gradients still live, LocalSGD holds one averaged copy of this rank's weights,
  DiLoCo a pseudo-gradient and a local copy (two); DiLoCo keeps its outer SGD momentum (one copy, on the
  device) for the whole run, and its backup of the last synchronized weights in host memory (on a CPU run the
  same memory, so counted).

The planner (``PlanTerms``, components/seams.py): each rank's fp32 shard all-reduced across the groups at the
inter-node bandwidth, every step (synchronous) or every ``sync_steps`` (semi-synchronous), not overlapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.group_seams import LocalGradients, NoFields, OneGroup, OwnCheckpoints, StopAnytime
from torchtitan.components.seams import PlanTerms
from torchtitan.features.fault_tolerance.replicas import average_in_buckets

if TYPE_CHECKING:
    from collections.abc import Callable

    from torchtitan.components.parts import CoreParts
    from torchtitan.config.manager import JobConfig
    from torchtitan.config.sections.fault_tolerance import FaultTolerance

# the estimate's rows of the semi-synchronous modes: copies at a synchronization, DiLoCo's outer state
SYNC_COPIES, OUTER_MOMENTUM, WEIGHT_BACKUP = "ft: sync copies", "ft: outer momentum", "ft: weight backup"


class EstimatedReplicas(OneGroup, LocalGradients, StopAnytime, OwnCheckpoints, NoFields):
    """The replica groups' seams on fake tensors: the same step, no lighthouse, no collective."""

    def __init__(self, ft: FaultTolerance):
        super().__init__()
        self.ft = ft
        self.outer_sum = (lambda tensor: ft.group_size) if ft.semi_sync_method is None else None

    def reduce_gradients(
        self, finish_gradients: Callable[[], list[torch.nn.Parameter]], loss: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.nn.Parameter]]:
        params = finish_gradients()
        if self.ft.semi_sync_method is None:
            average_in_buckets(params, lambda flat: None)  # the real run's buckets, averaged by nobody
        self.loss_max = loss
        return loss, params


def build_estimated_replicas(core: CoreParts) -> EstimatedReplicas:
    """The ``replicas`` seam of an estimate with ``fault_tolerance.enable`` (features/registry.py)."""
    return EstimatedReplicas(core.config.fault_tolerance)


def weight_bytes(model_parts: list[torch.nn.Module]) -> int:
    """Bytes of this rank's shards of the weights."""
    params = (p for part in model_parts for p in part.parameters())
    return sum(t.numel() * t.element_size() for t in (p.to_local() if isinstance(p, DTensor) else p for p in params))


def add_fault_tolerance_terms(memory: Any, ft: FaultTolerance, model_parts: list, device: torch.device) -> None:
    """What the replica groups add (module docstring), onto ``memory``: a note for the synchronous mode (its
    buckets are in the tracked step), the modeled copies and state of the semi-synchronous ones."""
    if ft.semi_sync_method is None:
        memory.notes.append(
            f"fault tolerance: one of {ft.group_size} replica groups; the gradient average across them (flat buckets "
            "of at most 32 MiB, one at a time) is in the tracked step, its process group holds nothing else"
        )
        return
    weights = weight_bytes(model_parts)
    copies = 1 if ft.semi_sync_method == "local_sgd" else 2
    memory.add_synchronization(
        SYNC_COPIES,
        copies * weights,
        f"fault tolerance ({ft.semi_sync_method}) modeled: {copies} cop{'y' if copies == 1 else 'ies'} of this "
        "rank's weights at each synchronization, after the optimizer step",
    )
    if ft.semi_sync_method == "diloco":
        memory.add_persistent(OUTER_MOMENTUM, weights, "DiLoCo's outer SGD momentum modeled: one copy of the weights")
        if device.type == "cpu":
            memory.add_persistent(
                WEIGHT_BACKUP, weights, "DiLoCo's backup of the synchronized weights modeled (host memory: on CPU)"
            )


class ReplicaPlanTerms(PlanTerms):
    """The estimate's and the planner's terms of a run with ``fault_tolerance.enable`` (the registry's ``plan``)."""

    def modeled_memory(self, memory: Any, config: JobConfig, model_parts: list, device: torch.device) -> None:
        add_fault_tolerance_terms(memory, config.fault_tolerance, model_parts, device)

    def comm_seconds(self, config: JobConfig, shard_params: float, inter_node_bytes_per_s: float) -> float:
        """The all-reduce of each rank's fp32 shard across the groups, per step; 0 with one group."""
        ft = config.fault_tolerance
        if ft.group_size < 2:
            return 0.0
        ring = 2 * shard_params * 4 * (ft.group_size - 1) / ft.group_size  # bytes a rank sends in a ring all-reduce
        every = 1 if ft.semi_sync_method is None else ft.sync_steps
        return ring / inter_node_bytes_per_s / every


def plan_terms(config: JobConfig) -> ReplicaPlanTerms:
    return ReplicaPlanTerms()
