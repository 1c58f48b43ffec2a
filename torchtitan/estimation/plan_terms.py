"""What an optional feature changes in ``estimation.py --plan``'s per-rank terms (plan.py): the parameters that
train, their bytes, the optimizer state's bytes and communication the layout's axes do not cover. A feature
names its terms in the registry (``Feature.plan``: LoRA's adapters, fault tolerance's cross-group all-reduce)."""

from __future__ import annotations

from typing import Any, Protocol

from torchtitan.preflight.registry import plan_terms


class PlanTerms(Protocol):
    """What an optional feature changes in the planner's per-rank terms (its builder: the registry's ``plan``);
    ``NoPlanTerms`` where none is on."""

    def trainable(self, config: Any, args: Any, params: int) -> int:
        """The parameters with gradients and optimizer state, of ``params``."""

    def param_bytes(self, config: Any, args: Any, params: int) -> int:
        """Bytes of the model's parameters."""

    def state_bytes(self, config: Any, args: Any, trainable: int) -> int | None:
        """The optimizer state's bytes; None: the optimizer's own rules over the whole model."""

    def comm_seconds(self, config: Any, shard_params: float, inter_node_bytes_per_s: float) -> float:
        """Seconds per step of communication the layout's axes do not cover (``shard_params``: a rank's)."""


class NoPlanTerms:
    def trainable(self, config: Any, args: Any, params: int) -> int:
        return params

    def param_bytes(self, config: Any, args: Any, params: int) -> int:
        return params * 4  # fp32

    def state_bytes(self, config: Any, args: Any, trainable: int) -> int | None:
        return None

    def comm_seconds(self, config: Any, shard_params: float, inter_node_bytes_per_s: float) -> float:
        return 0.0


def feature_terms(config) -> PlanTerms:
    """The one enabled feature's planner terms, or ``NoPlanTerms``."""
    found = plan_terms(config)
    assert len(found) <= 1, f"two features change the planner's terms: {found}"
    return found[0] if found else NoPlanTerms()
