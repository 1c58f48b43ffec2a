"""Qwen3 and Qwen3-MoE flavors: published sizes on the meta device, and the same count as transformers' model."""

from __future__ import annotations

import pytest
import torch

from torchtitan.models.qwen3 import Qwen3MoETransformer, Qwen3Transformer, qwen3_configs, qwen3_moe_configs
from torchtitan.spec import get_model_spec

# model cards: total and non-embedding (dense) or active (MoE) parameters, in billions as published
QWEN3_CARDS = {"0.6B": (0.6, 0.44), "1.7B": (1.7, 1.4), "4B": (4.0, 3.6), "8B": (8.2, 6.95), "14B": (14.8, 13.2)}
QWEN3_CARDS["32B"] = (32.8, 31.2)
QWEN3_MOE_CARDS = {"30B-A3B": (30.5, 3.3), "235B-A22B": (235, 22)}
EXACT = {
    "0.6B": 596_049_920,
    "1.7B": 1_720_574_976,
    "4B": 4_022_468_096,
    "8B": 8_190_735_360,
    "14B": 14_768_307_200,
    "32B": 32_762_123_264,
    "30B-A3B": 30_532_122_624,
    "235B-A22B": 235_093_634_560,
}


def _matches(x: float, card: float) -> bool:
    """Within one unit of the card's last digit (cards round or truncate: 3.35B active is "3.3B")."""
    digits = len(str(card).split(".")[1]) if "." in str(card) else 0
    return abs(x - card) < 10**-digits


@pytest.mark.parametrize("flavor", QWEN3_CARDS)
def test_qwen3_flavors_have_the_published_sizes(flavor):
    args = qwen3_configs[flavor]
    with torch.device("meta"):
        model = Qwen3Transformer(args)
    total = sum(p.numel() for p in model.parameters())
    tables = 1 if args.tie_word_embeddings else 2  # the card's non-embedding count leaves out both tables
    non_embedding = total - tables * args.vocab_size * args.dim
    card_total, card_non_embedding = QWEN3_CARDS[flavor]
    assert total == EXACT[flavor]
    assert _matches(total / 1e9, card_total) and _matches(non_embedding / 1e9, card_non_embedding)


@pytest.mark.parametrize("flavor", QWEN3_MOE_CARDS)
def test_qwen3_moe_flavors_have_the_published_sizes(flavor):
    args = qwen3_moe_configs[flavor]
    with torch.device("meta"):
        model = Qwen3MoETransformer(args)
    total = sum(p.numel() for p in model.parameters())
    active = get_model_spec("qwen3_moe").count_flop_params(args, model) + args.vocab_size * args.dim
    card_total, card_active = QWEN3_MOE_CARDS[flavor]
    assert total == EXACT[flavor]
    assert _matches(total / 1e9, card_total) and _matches(active / 1e9, card_active)


@pytest.mark.parametrize("flavor", ["0.6B", "8B", "30B-A3B"])
def test_counts_equal_transformers_models_of_the_same_config(flavor):
    transformers = pytest.importorskip("transformers")
    moe = flavor in qwen3_moe_configs
    args = (qwen3_moe_configs if moe else qwen3_configs)[flavor]
    common = dict(
        hidden_size=args.dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    with torch.device("meta"):
        if moe:
            config = transformers.Qwen3MoeConfig(
                **common,
                moe_intermediate_size=args.moe_hidden_dim,
                num_experts=args.num_experts,
                num_experts_per_tok=args.top_k,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
            hf = transformers.Qwen3MoeForCausalLM(config)
        else:
            hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, intermediate_size=args.ffn_dim))
    assert sum(p.numel() for p in hf.parameters()) == EXACT[flavor]
