"""Pre-launch: where ``training.cuda_graphs`` is built (light: the preflight runs it; the blocks compile in
distributed/parallelize.py ``apply_compile``).

With it each compiled dense block compiles with ``mode="reduce-overhead"`` (torch 2.11 to 2.13: inductor's
``triton.cudagraphs``, through CUDA graph trees): its kernels are recorded once and replayed each step, so the host
launches one graph where it launched every kernel. A replayed graph's outputs and gradients live in the graphs' memory
pool and are overwritten by the graph's next replay, which fixes what it composes with:

- gradient accumulation and pipeline parallel's micro-batches run a block's forward and backward again while the
  first micro-batch's gradients, held in ``.grad``, are still to be added to (torch: "accessing gradient tensor
  output of CUDAGraphs that has been overwritten by a subsequent run"); step replay is fine: it reads the first
  pass's gradients (their checksums) and sets them to None before the replay;
- FSDP gathers each block's parameters into memory it frees after use, so the recorded addresses go stale (the trees
  record the graph again); TP puts its collectives inside the blocks and CP swaps attention for an eager ring: none
  of them is built;
- an MoE block compiles around its routed experts, which run eagerly between two graphs (the grouped matmul sized by
  the routing; EP's splits read on the host), so only the parts around them would be recorded while every expert
  kernel still launches from the host, and the MoE keeps tensors its graph returns as module state (its token counts
  and aux loss) that the next replay overwrites: not built (CUDA graph trees themselves allow eager code between
  graphs, so this is a choice, not torch's limit);
- transformers' decoder layers (``model.name = "hf"``) compile without fullgraph, MoE architectures among them: not
  built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan.config.errors import ConfigError
from torchtitan.models.moe.args import MoEArgs
from torchtitan.spec import flavor_args

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

_KEY = "training.cuda_graphs = true"


def check_cuda_graphs(config: JobConfig, dims: ParallelDims) -> list[str]:
    """What ``training.cuda_graphs`` needs (compile) and what it is not built with, one line each.

    Raises:
        ConfigError: without ``training.compile``.
        NotImplementedError: a family or a layout it is not built for, naming it and what to set.
    """
    t = config.training
    if not t.cuda_graphs:
        return []
    if not t.compile:
        raise ConfigError(
            f"{_KEY} needs training.compile = true: CUDA graphs are recorded from the compiled blocks' kernels; set "
            "training.compile = true or remove training.cuda_graphs"
        )
    if config.activation_checkpoint.mode == "memory_budget":
        raise NotImplementedError(
            f"{_KEY} with activation_checkpoint.mode = 'memory_budget': the budget compiles the blocks through a "
            "backend of its own (inductor under the budget), which takes no compile mode; not built: use mode "
            "'full' or 'selective' with CUDA graphs, or turn them off"
        )
    name = config.model.name
    if name == "hf":
        raise NotImplementedError(
            f"{_KEY} with model.name = 'hf': transformers' decoder layers compile without fullgraph (MoE "
            "architectures among them) and are not built for CUDA graphs; set training.cuda_graphs = false"
        )
    if isinstance(flavor_args(config.model), MoEArgs):
        raise NotImplementedError(
            f"{_KEY} with model.name = {name!r} (an MoE family): its routed experts run eagerly between the block's "
            "two graphs, their kernels launched from the host, and the MoE keeps graph outputs as module state (token "
            "counts, aux loss) that a replay overwrites; not built: set training.cuda_graphs = false (MoE blocks "
            "compile without it)"
        )
    again = [
        (t.gradient_accumulation_steps > 1, f"training.gradient_accumulation_steps = {t.gradient_accumulation_steps}"),
        (dims.pp_enabled, f"experimental.pipeline_parallel_degree = {dims.pp}"),
    ]
    for on, what in again:
        if on:
            raise NotImplementedError(
                f"{_KEY} with {what}: the next micro-batch's replay would overwrite the gradients the first one left "
                "in the CUDA graphs' pool before they are added to; turn one of them off (a larger "
                "training.batch_size gives the same batch)"
            )
    layouts = [
        (dims.fsdp_enabled, f"FSDP (data_parallel_shard_degree = {dims.dp_shard})", "its gathered parameters move"),
        (dims.tp_enabled, f"training.tensor_parallel_degree = {dims.tp}", "its collectives are in the blocks"),
        (dims.cp_enabled, f"experimental.context_parallel_degree = {dims.cp}", "its ring is eager point-to-point"),
    ]
    for on, what, why in layouts:
        if on:
            raise NotImplementedError(
                f"{_KEY} with {what}: not built ({why}); CUDA graphs are built for one process or DDP "
                "(data_parallel_replicate_degree)"
            )
    return []


def check_cuda_graphs_device(config: JobConfig, dims: ParallelDims, device_type: str) -> list[str]:
    """CUDA graphs are CUDA's: refused on any other device, in one line."""
    if config.training.cuda_graphs and device_type != "cuda":  # device-choice: CUDA graphs exist on CUDA only
        raise ConfigError(f"training.cuda_graphs needs a CUDA device; this run's device is {device_type}")
    return []
