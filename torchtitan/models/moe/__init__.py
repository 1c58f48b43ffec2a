"""Llama 3 MoE flavors ("llama3_moe").

debugmodel: llama3's debugmodel (dim 256, 8 layers, 16 heads) with every layer after the first an
MoE of 8 experts (top 2, width 256) plus one shared expert. It balances with the DeepSeek-V3
recipe: sigmoid scores, normalised top-k weights and the aux-loss-free expert bias. The bias needs
no extra loss term, so it works the same under pipeline parallel (where middle stages cannot add
to the loss) and under activation checkpointing; the trainer only calls ``update_expert_bias``.

debugmodel_tiny: the loss-parity tests' size (dim 64, 4 layers, 4 experts of width 64, top 2).

debugmodel_nano: the shipped old-checkpoint assets' size (dim 32, 2 layers, 4 experts of width 32).

debugmodel_aux_loss: the same shape with softmax scores and the switch-style aux loss, which the
trainer adds to each micro-batch's loss (not under pipeline parallel).
"""

import dataclasses

from torchtitan.models.moe.args import MoEArgs
from torchtitan.models.moe.model import MoETransformer, num_active_params
from torchtitan.models.moe.moe import GroupedExperts, MoE, TokenChoiceRouter

__all__ = [
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "MoETransformer",
    "TokenChoiceRouter",
    "moe_configs",
    "num_active_params",
]

moe_configs = {
    "debugmodel": MoEArgs(
        dim=256,
        n_layers=8,
        n_heads=16,
        rope_theta=500000,
        max_seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_hidden_dim=256,
        num_shared_experts=1,
        first_k_dense=1,
        score_func="sigmoid",
        route_norm=True,
        load_balance="bias",
    ),
}
# The loss-parity tests' size: dim 64, 4 layers (layer 0 dense), 4 experts of width 64, top 2.
moe_configs["debugmodel_tiny"] = dataclasses.replace(
    moe_configs["debugmodel"], dim=64, n_layers=4, n_heads=4, num_experts=4, moe_hidden_dim=64
)
# The shipped old-checkpoint assets' size (tests/assets/checkpoints): dim 32, 2 layers (layer 0 dense), 4 experts
# of width 32.
moe_configs["debugmodel_nano"] = dataclasses.replace(
    moe_configs["debugmodel"], dim=32, n_layers=2, n_heads=2, multiple_of=32, num_experts=4, moe_hidden_dim=32
)
# The same shape balanced with the switch-style aux loss instead (softmax scores, no bias).
moe_configs["debugmodel_aux_loss"] = dataclasses.replace(
    moe_configs["debugmodel"], score_func="softmax", route_norm=False, load_balance="aux_loss"
)
