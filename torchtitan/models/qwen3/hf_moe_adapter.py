"""The qwen3_moe family's Hugging Face adapter: our weights <-> ``Qwen3MoeForCausalLM`` (published per-expert layout).

Our experts are stacked: ``feed_forward.experts.w1`` (E, hidden, dim) holds every expert's gate_proj,
``w3`` the up_proj, ``w2`` (E, dim, hidden) the down_proj; HF checkpoints store one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``; transformers >= 5 fuses them in memory and writes this layout).
The router is ``mlp.gate``. Everything else is Qwen3's (qwen3/hf_adapter.py).
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.qwen3 import hf_adapter as qwen3

_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ROUTER = ("feed_forward.router.gate.weight", "mlp.gate.weight")


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    rest, out = {}, {}
    for key, w in sd.items():
        layer_suffix = key.split(".", 2)
        if key.startswith("layers.") and layer_suffix[2].startswith("feed_forward.experts."):
            name = _EXPERTS[layer_suffix[2].rsplit(".", 1)[1]]
            for e in range(w.shape[0]):
                out[f"model.layers.{layer_suffix[1]}.mlp.experts.{e}.{name}.weight"] = w[e].contiguous()
        elif key.startswith("layers.") and layer_suffix[2] == _ROUTER[0]:
            out[f"model.layers.{layer_suffix[1]}.{_ROUTER[1]}"] = w.contiguous()
        else:
            rest[key] = w
    return {**qwen3.to_hf_state_dict(rest, args), **out}


def from_hf_state_dict(hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
    rest, experts, out = {}, {}, {}
    by_hf = {v: k for k, v in _EXPERTS.items()}
    for key, w in hf.items():
        parts = key.split(".")  # model, layers, i, mlp, experts, e, name, weight
        if len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[6] in by_hf:
            experts.setdefault((parts[2], by_hf[parts[6]]), {})[int(parts[5])] = w
        elif len(parts) == 6 and ".".join(parts[3:]) == _ROUTER[1]:
            out[f"layers.{parts[2]}.{_ROUTER[0]}"] = w.contiguous()
        else:
            rest[key] = w
    for (layer, ours), per_expert in experts.items():
        if sorted(per_expert) != list(range(args["num_experts"])):
            raise ValueError(f"layer {layer}: expected experts 0..{args['num_experts'] - 1}, got {sorted(per_expert)}")
        out[f"layers.{layer}.feed_forward.experts.{ours}"] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    return {**qwen3.from_hf_state_dict(rest, args), **out}


def hf_config(args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``Qwen3MoeForCausalLM`` (every layer MoE)."""
    config = qwen3.hf_config(args, {"layers.0.feed_forward.w1.weight": torch.empty(args["ffn_dim"], 0)}, dtype)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    config.update(
        num_experts=args["num_experts"],
        num_experts_per_tok=args["top_k"],
        moe_intermediate_size=args["moe_hidden_dim"],
        norm_topk_prob=args["route_norm"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=args["aux_loss_coeff"],
        output_router_logits=False,
    )
    return config


def model_args_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """Our Qwen3MoEArgs fields (as a dict) from an HF Qwen3-MoE ``config.json``.

    Raises:
        NotImplementedError: dense layers among the MoE ones (``mlp_only_layers``, ``decoder_sparse_step``).
    """
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise NotImplementedError(
            "HF config mlp_only_layers / decoder_sparse_step: our Qwen3-MoE has every layer MoE; got "
            f"mlp_only_layers = {config.get('mlp_only_layers')}, decoder_sparse_step = {config.get('decoder_sparse_step')}"
        )
    args = qwen3.model_args_from_hf(config)
    args.update(
        num_experts=config.get("num_experts") or config["num_local_experts"],  # published | transformers >= 5
        top_k=config["num_experts_per_tok"],
        moe_hidden_dim=config["moe_intermediate_size"],
        route_norm=bool(config.get("norm_topk_prob", False)),
        aux_loss_coeff=config.get("router_aux_loss_coef", 0.001),
    )
    return args
