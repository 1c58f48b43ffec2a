"""A tiny Qwen3.5 (dense or MoE) built in process, its weights drawn and its norms moved off their zero init."""

from __future__ import annotations

import dataclasses

import torch

from torchtitan.build import build_meta_model
from torchtitan.distributed.init import init_model_weights
from torchtitan.spec import get_model_spec

VOCAB = 512


def tiny_qwen3_5(seed: int = 0, family: str = "qwen3_5"):
    """The tiny flavor (4 layers: 3 Gated DeltaNet, 1 full attention), its norms moved off their zero init; the
    MoE's balanced by the aux loss (as transformers' is: no expert bias)."""
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=VOCAB, max_seq_len=128)
    if family == "qwen3_5_moe":
        args = dataclasses.replace(args, load_balance="aux_loss")
    model = build_meta_model(spec, args)
    model.to_empty(device="cpu")
    init_model_weights(model, seed, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model.eval(), dataclasses.asdict(args)
