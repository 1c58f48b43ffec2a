"""torch's Adam and AdamW, stepped on each DTensor's local shard instead of through DTensor dispatch.

Adam's update is elementwise, so over a sharded or replicated parameter it is the same arithmetic on each rank's
shard, and DTensor's foreach dispatch runs exactly that: the same foreach kernels on the local tensors. What that
dispatch adds is its sharding propagation, which torch 2.13 computes per tensor of the list by expanding every
single-dimension strategy to the whole mesh, for each foreach op of the update, the first time a layout steps, and
then looks each op up again every step. Measured (``bench/optimizer_first_step.py``, the parity flavor's 39
parameters, CPU seconds of a rank): the first step 0.197 -> 0.007 at FSDP2 x 2 and 1.38 -> 0.008 at HSDP 2x2 x TP2
on 8 ranks; a later step 2.2 -> 1.4 ms. Stepping the local shards leaves the numbers bit for bit (the same kernels
on the same data) and the state as it was: created by torch with the parameter's placements (``zeros_like`` of the
DTensor), so checkpoints and DCP's optimizer state dict are unchanged.

A gradient whose placements differ from its parameter's (a Partial one nobody reduced yet) is first
redistributed to the parameter's, as DTensor's dispatch would; ``optim_lowp.LowPrecisionAdamW`` and Muon's
momentum already step local shards the same way.
"""

from __future__ import annotations

import torch

from torchtitan.distributed.backend.dtensor import in_layout_of, local_shard


class LocalShards:
    """Mixin before ``torch.optim.Adam`` (or a subclass): the lists its ``step`` hands to ``adam()`` hold the
    parameters', gradients' and moments' local shards. Hooks into ``Adam._init_group``, which fills them."""

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = super()._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        grads[:] = [in_layout_of(p, g) for p, g in zip(params, grads, strict=True)]
        for tensors in (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs):
            tensors[:] = [local_shard(t) for t in tensors]
        return has_complex


class Adam(LocalShards, torch.optim.Adam):
    """``torch.optim.Adam`` on local shards (module docstring)."""


class AdamW(LocalShards, torch.optim.AdamW):
    """``torch.optim.AdamW`` on local shards (module docstring)."""
