"""What a healing replica group receives from a live one: torchft's ``state_dict`` / ``load_state_dict`` pair.

A live group's rank r sends its own shards to the healing group's rank r (torchft's HTTP checkpoint transport
pairs equal group ranks), so the payload is *local* tensors: the groups run the same layout (checked with the
config fingerprint), and a DTensor need not be pickled. Sent: model weights and persistent buffers (an MoE
expert bias), the optimizer state (the checkpoint's per-parameter layout, so a group that never stepped gets
one), the lr schedule, and every group's data position. torchft adds the step.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.checkpointing.state import ModelState, OptimizerState
from torchtitan.features.fault_tolerance.errors import ReplicaGroupsFailed

if TYPE_CHECKING:
    from torch import nn

    from torchtitan.features.fault_tolerance.positions import DataPositions

logger = logging.getLogger(__name__)


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


class HealState:
    """The state torchft moves between groups; ``healed`` counts the heals applied here."""

    def __init__(
        self,
        *,
        view: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        positions: DataPositions,
        replica_id: int,
        fingerprint: int,
    ):
        self.view, self.optimizer, self.lr_scheduler = view, optimizer, lr_scheduler
        self.positions, self.replica_id, self.fingerprint = positions, replica_id, fingerprint
        self.healed = 0
        self.last_source: int | None = None
        self.data_moved = False  # the last heal replaced the loader's position

    def state_dict(self) -> dict[str, Any]:
        """Called by torchft in its quorum thread while the main thread waits for the quorum (nothing steps)."""
        return {
            "source": self.replica_id,
            "fingerprint": self.fingerprint,
            "model": {k: _local(v) for k, v in ModelState(self.view).state_dict().items()},
            "optimizer": {k: _local(v) for k, v in OptimizerState(self.view, self.optimizer).state_dict().items()},
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "data": self.positions.records(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Applied by torchft on the main thread inside ``start_quorum``, before this step's forward pass."""
        if state["fingerprint"] != self.fingerprint:
            raise ReplicaGroupsFailed(
                f"fault tolerance: replica group {self.replica_id} cannot heal from group {state['source']}: they run "
                "different configs (model, training, optimizer, parallel layout or number of ranks); launch every "
                "group with the same command but for --fault_tolerance.replica_id"
            )
        live = self.view.state_dict()
        if set(live) != set(state["model"]):
            raise ReplicaGroupsFailed(
                f"fault tolerance: group {state['source']}'s weights have other names than this group's "
                f"({sorted(set(live) ^ set(state['model']))[:3]}); launch every group with the same command"
            )
        for key, tensor in live.items():
            _local(tensor).copy_(state["model"][key])
        OptimizerState(self.view, self.optimizer).load_state_dict(self._as_placed(state["optimizer"]))
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.data_moved = self.positions.adopt(state["data"])
        self.healed += 1
        self.last_source = state["source"]

    def _as_placed(self, flat: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's flat state with each sharded parameter's local tensors placed like the parameter."""
        params = dict(self.view.named_parameters())
        out = {}
        for key, value in flat.items():
            out[key] = value
            if not key.startswith("state.") or not isinstance(value, torch.Tensor):
                continue
            param = params.get(key[len("state.") :].rsplit(".", 1)[0])
            if isinstance(param, DTensor) and value.shape == param.to_local().shape:
                out[key] = DTensor.from_local(
                    value.to(param.device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
        return out


@torch.no_grad()
def weights_digest(view: nn.Module) -> str:
    """A digest of the replica group's weights and persistent buffers: every rank hashes its local shards (the
    groups share one layout, so equal weights give equal digests), rank 0 of the group combines them."""
    h = hashlib.sha256()
    for key, value in view.state_dict().items():
        local: Any = value.to_local() if hasattr(value, "to_local") else value
        h.update(key.encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = h.hexdigest()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine[:16]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return hashlib.sha256("".join(every).encode()).hexdigest()[:16]
