"""The ``[fault_tolerance]`` section of the config tree (torchtitan/config/schema.py holds the tree).

Keys and defaults are torchtitan's (2025) spelling, so upstream's flags work unchanged; the DiLoCo outer
optimizer's settings (upstream hard-codes them) and the quorum timeout are this trainer's own. Upstream's
Streaming DiLoCo and quantization keys are accepted at their defaults only (config/compat/keys_2025.py). What each
key does: docs/fault_tolerance.md. The lighthouse address comes from ``TORCHFT_LIGHTHOUSE``, as upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torchtitan.config.bounds import Bound
from torchtitan.config.compat.spellings import Fixed, Rule
from torchtitan.config.fields import POSITIVE as _POSITIVE
from torchtitan.config.fields import config_field as _f

_STREAMING = (
    "Streaming DiLoCo (several model fragments synced at different steps) is not built; diloco syncs the whole model"
)


@dataclass
class FaultTolerance:
    # The 2025 schema (config/compat/keys_2025.py reads these of every section): its keys spelled and meant as here,
    # and its keys accepted at their defaults only.
    SHARED_2025: ClassVar[tuple[str, ...]] = (
        "enable",
        "replica_id",
        "group_size",
        "min_replica_size",
        "process_group",
        "process_group_timeout_ms",
        "semi_sync_method",
        "sync_steps",
    )
    RULES_2025: ClassVar[dict[str, Rule]] = {
        "should_quantize": Fixed(
            bool, False, "torchft's quantized (fp8) all-reduce needs CUDA with triton; not built here"
        ),
        "fragment_sync_delay": Fixed(int, 0, _STREAMING),
        "fragment_update_alpha": Fixed(float, 0.0, _STREAMING),
        "num_fragments": Fixed(int, 1, _STREAMING),
        "module_fqns_per_model_fragment": Fixed("raw", [], _STREAMING),
    }

    enable: bool = _f(
        False,
        "train as one replica group of a torchft job (needs `pip install -e '.[ft]'` and a lighthouse at "
        "TORCHFT_LIGHTHOUSE): the groups average gradients each step, a group that dies is dropped and the others "
        "go on, a restarted group heals from a live one (docs/fault_tolerance.md)",
    )
    replica_id: int = _f(0, "this launch's replica group, 0 .. group_size - 1", bound=Bound(ge=0))
    group_size: int = _f(
        0,
        "the number of replica groups (the replicate dimension); the data is sharded over all of them, so with every "
        "group alive a step is HSDP's with data_parallel_replicate_degree = group_size; must be >= 1 with enable",
        bound=Bound(ge=0),
    )
    min_replica_size: int = _f(
        1, "live replica groups a step needs to commit; with fewer the step is discarded and retried", bound=_POSITIVE
    )
    process_group: Literal["gloo", "nccl"] = _f(  # device-choice: the backend between groups, checked before launch
        "gloo", "backend of the process group between replica groups (nccl needs CUDA)"
    )
    process_group_timeout_ms: int = _f(
        10000,
        "a collective between replica groups fails after this long (a hung peer); it also bounds how long live "
        "groups wait in a step for a healing group, so set it above a heal transfer's time",
        bound=_POSITIVE,
    )
    quorum_timeout_seconds: int = _f(
        60,
        "how long a step may wait for a quorum of the lighthouse, or go without committing because fewer than "
        "min_replica_size groups are live, before the run stops with one line (exit 5)",
        bound=_POSITIVE,
    )
    semi_sync_method: Literal["local_sgd", "diloco"] | None = _f(
        None,
        "None: every step averages gradients across groups. local_sgd: each group steps alone and the weights are "
        "averaged every sync_steps; diloco: every sync_steps the averaged weight change is applied by the outer "
        "optimizer (torchft's LocalSGD / DiLoCo)",
    )
    sync_steps: int = _f(5, "with semi_sync_method: steps between synchronizations", bound=_POSITIVE)
    outer_lr: float = _f(0.7, "diloco: the outer optimizer's learning rate (SGD; upstream's value)", bound=Bound(gt=0))
    outer_momentum: float = _f(0.9, "diloco: the outer SGD's momentum (upstream's value)", bound=Bound(ge=0))
    outer_nesterov: bool = _f(True, "diloco: Nesterov momentum in the outer SGD (upstream's value)")

    def run_subfolder(self) -> str | None:
        """Where this launch's own files go under the dump folder (launch/run_folder.py): its replica group's."""
        return f"replica_{self.replica_id}" if self.enable else None

    def checkpoint_subfolder(self) -> str | None:
        """The groups share the checkpoint folder (the lowest live one writes it), except in the semi-synchronous
        modes, where each group keeps its own (their optimizers' states differ)."""
        return f"replica_{self.replica_id}" if self.enable and self.semi_sync_method else None
