"""Qwen3.5's text model (``model.name = "qwen3_5"``), in process: logits equal transformers' ``Qwen3_5ForCausalLM``
with the same weights; the chunked gated delta rule equals the token-by-token one; packed documents equal the
documents alone; the HF conversion round-trips; HF configs we do not build are refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from torchtitan.build import build_meta_model
from torchtitan.distributed.init import init_model_weights
from torchtitan.models.qwen3_5.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule
from torchtitan.models.qwen3_5.hf_adapter import QWEN3_5
from torchtitan.spec import get_model_spec

SPEC = get_model_spec("qwen3_5")
VOCAB = 512


def _built(seed: int = 0):
    """The tiny flavor (4 layers: 3 Gated DeltaNet, 1 full attention), its norms moved off their zero init."""
    args = dataclasses.replace(SPEC.flavors["debugmodel_tiny"], vocab_size=VOCAB, max_seq_len=128)
    model = build_meta_model(SPEC, args)
    model.to_empty(device="cpu")
    init_model_weights(model, seed, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model.eval(), dataclasses.asdict(args)


def _transformers(model, fields):
    config = QWEN3_5.hf_config(fields, {}, torch.float32)
    model_type = config.pop("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k not in ("architectures",)})
    config._attn_implementation = "sdpa"
    theirs = AutoModelForCausalLM.from_config(config).eval()
    theirs.load_state_dict(QWEN3_5.to_hf_state_dict(model.state_dict(), fields))
    return theirs


def test_logits_equal_transformers():
    """40 tokens: the tiny flavor's chunk of 16 pads the last chunk (transformers' rule runs chunks of 64)."""
    model, fields = _built()
    theirs = _transformers(model, fields)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, want = model(tokens), theirs(input_ids=tokens).logits
    gap = ((ours - want).abs().max() / want.abs().max()).item()
    assert gap <= 1e-5, gap


@pytest.mark.parametrize(("length", "chunk"), [(37, 8), (64, 16), (5, 16), (50, 64)])
def test_chunked_rule_equals_the_recurrent_rule(length, chunk):
    """Random inputs, value heads twice the key heads, from a random state; outputs and final states within 1e-6."""
    gen = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, length, 4, 6, generator=gen)
    g = -torch.rand(2, length, 4, generator=gen) * 2  # log decays in (-2, 0]
    beta = torch.rand(2, length, 4, generator=gen)
    state = torch.randn(2, 4, 8, 6, generator=gen) * 0.1
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    got, got_state = chunked_gated_delta_rule(q, k, v, g, beta, chunk, state)
    assert (got - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item())
    assert (got_state - want_state).abs().max() <= 1e-6 * max(1.0, want_state.abs().max().item())


def test_packed_documents_equal_documents_alone():
    """block_causal: three documents packed in a row (per-document positions) give each document's logits alone:
    no Gated DeltaNet state or convolution history crosses a boundary; without the documents the later ones
    change (the check can fail)."""
    model, _ = _built()
    lengths = (20, 9, 11)
    docs = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    tokens = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(tokens, positions, doc_ids=doc_ids).split(lengths, dim=1)
        alone = [model(doc) for doc in docs]
        causal = model(tokens).split(lengths, dim=1)
    for i, (p, a) in enumerate(zip(packed, alone)):
        assert (p - a).abs().max() <= 1e-5 * a.abs().max(), f"document {i}"
    assert (causal[1] - alone[1]).abs().max() > 1e-3


def test_hf_conversion_round_trips():
    model, fields = _built()
    ours = model.state_dict()
    hf = QWEN3_5.to_hf_state_dict(ours, fields)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in hf and "model.layers.3.self_attn.q_proj.weight" in hf
    back = QWEN3_5.from_hf_state_dict(hf, fields)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    read = QWEN3_5.model_args_from_hf(QWEN3_5.hf_config(fields, ours, torch.float32))
    assert {k: fields[k] for k in read} == read


@pytest.mark.parametrize(
    ("layer_types", "expected"),
    [
        (["linear_attention", "mamba", "linear_attention", "full_attention"], "layer_types has ['mamba']"),
        (["full_attention", "linear_attention", "linear_attention", "full_attention"], "at every k-th layer"),
    ],
)
def test_hf_configs_we_do_not_build_are_refused_in_one_line(layer_types, expected):
    _, fields = _built()
    config = {**QWEN3_5.hf_config(fields, {}, torch.float32), "layer_types": layer_types}
    with pytest.raises(NotImplementedError) as info:
        QWEN3_5.model_args_from_hf(config)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("flavor", ["0.8B", "2B", "4B", "9B", "27B"])
def test_published_flavors_have_transformers_parameter_count(flavor):
    """Each published flavor built on the meta device has as many parameters as transformers' model of the config
    our adapter writes for it (a tied head counted once)."""
    args = SPEC.flavors[flavor]
    with torch.device("meta"):
        ours = SPEC.model_cls(dataclasses.replace(args, max_seq_len=16))
        config = QWEN3_5.hf_config(dataclasses.asdict(args), {}, torch.float32)
        model_type = config.pop("model_type")
        theirs = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "architectures"})
        )
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()), flavor
    print(f"{flavor}: {count:,} parameters")


def test_mfu_counts_attention_in_full_attention_layers_and_the_recurrence():
    """MFU's FLOPs per token: softmax attention in the 1 full-attention layer of the tiny flavor's 4, Gated DeltaNet's
    chunked matmuls in the other 3 (docs/metrics.md's formula, by hand here); a llama's args count every layer."""
    from torchtitan.observability.metrics import compute_num_flops_per_token, model_flops_per_token

    args = SPEC.flavors["debugmodel_tiny"]
    c, dk, dv, heads = 16, 16, 16, 4
    recurrence = 3 * (4 * c * dk + 2 * c * dv + 6 * dk * dv) * heads * 3  # 3 Gated DeltaNet layers
    assert model_flops_per_token(1000, args, 64) == 6 * 1000 + 12 * 1 * 4 * 16 * 64 + recurrence
    llama = get_model_spec("llama3").flavors["debugmodel_tiny"]
    assert model_flops_per_token(1000, llama, 64) == compute_num_flops_per_token(
        1000, llama.n_layers, llama.n_heads, llama.head_dim, 64
    )
