"""``model.name = "hf"`` in process: each tiny architecture built by our path equals transformers' own class with the
same weights; initialisation is a function of the seed and the module names (activation checkpointing's wrappers
change neither); the HF conversion round-trips."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from torchtitan.build import build_meta_model
from torchtitan.distributed.activation_checkpoint import wrap_block
from torchtitan.distributed.init import init_model_weights
from torchtitan.models.hf.spec import HF, SPEC, TINY, from_hf_config


def _built(flavor: str, seed: int = 0, *, ac: bool = False):
    args = dataclasses.replace(SPEC.flavors[flavor], vocab_size=2048, max_seq_len=64)
    model = build_meta_model(SPEC, args)
    if ac:
        layers = model.decoder_layers
        for i in range(len(layers)):
            layers[i] = wrap_block(layers[i], op_selective=False)
    model.to_empty(device="cpu")
    init_model_weights(model, seed, torch.device("cpu"))
    return model, args


@pytest.mark.parametrize("flavor", list(TINY))
def test_logits_equal_transformers(flavor):
    model, _ = _built(flavor)
    theirs = AutoModelForCausalLM.from_config(model.hf.config)
    theirs.load_state_dict({k.removeprefix("hf."): v for k, v in model.state_dict().items()})
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        assert torch.equal(ours, theirs(input_ids=tokens).logits)
        # the chunked loss's split: hidden state, then the head
        assert torch.equal(model.output(model(tokens, return_hidden=True)), ours)


def test_initialisation_is_a_function_of_the_seed_and_names():
    a, _ = _built("gemma3_tiny", seed=3)
    b, _ = _built("gemma3_tiny", seed=3, ac=True)  # checkpoint wrappers rename nothing the seeds read
    c, _ = _built("gemma3_tiny", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["hf.model.layers.0.mlp.up_proj.weight"], sc["hf.model.layers.0.mlp.up_proj.weight"])
    assert a.hf.lm_head.weight is a.hf.model.embed_tokens.weight  # Gemma 3 ties its head, and keeps it tied


@pytest.mark.parametrize("flavor", ["phi3_tiny", "gemma3_tiny"])
def test_hf_conversion_round_trips(flavor):
    model, args = _built(flavor)
    ours = model.state_dict()
    fields = dataclasses.asdict(args)
    hf = HF.to_hf_state_dict(ours, fields)
    assert "lm_head.weight" not in hf if args.tie_word_embeddings else "lm_head.weight" in hf
    back = HF.from_hf_state_dict(hf, fields)
    assert all(torch.equal(back[k], ours[k]) for k in back) and set(ours) - set(back) <= {"hf.lm_head.weight"}
    config = HF.hf_config(fields, hf, dtype=torch.float32)
    again = from_hf_config(config, "config.json")
    assert (again.n_layers, again.dim, again.n_heads, again.head_dim) == (
        args.n_layers,
        args.dim,
        args.n_heads,
        args.head_dim,
    )
    assert config["vocab_size"] == 2048 and config["architectures"] == [type(model.hf).__name__]


def test_built_to_load_weights_equals_transformers():
    """As scripts/generate.py builds a checkpoint's model: to_empty, init_buffers (the rotary tables, Gemma 3's
    embedding scale), then the weights: transformers' logits, and KVCache.fits says the cache is not ours."""
    from torchtitan.components.generation import KVCache

    trained, args = _built("gemma3_tiny", seed=5)
    model = build_meta_model(SPEC, args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(trained.state_dict())
    theirs = AutoModelForCausalLM.from_config(model.hf.config)
    theirs.load_state_dict({k.removeprefix("hf."): v for k, v in trained.state_dict().items()})
    tokens = torch.randint(0, 2048, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(tokens), theirs(input_ids=tokens).logits)
    assert not KVCache.fits(model)


@pytest.mark.parametrize("flavor", list(TINY))
def test_packed_documents_equal_documents_alone(flavor):
    """block_causal with positions per document: a packed row's logits are each document's alone (Gemma 3's
    sliding window of 8 inside a 10-token document, MoE routing per token); with positions running on across
    them, the later documents' logits change (the check can fail)."""
    model, _ = _built(flavor)
    lengths = (10, 8, 6)
    docs = [torch.randint(0, 2048, (1, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    tokens = torch.cat(docs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(tokens, positions, doc_ids).split(lengths, dim=1)
        alone = [model(doc, torch.arange(doc.shape[1])[None]) for doc in docs]
        running_on = model(tokens, torch.arange(tokens.shape[1])[None]).split(lengths, dim=1)
    for i, (p, a) in enumerate(zip(packed, alone)):
        gap = (p - a).abs().max().item()
        assert gap <= 1e-5 * a.abs().max().item(), f"{flavor} document {i}: packed vs alone {gap}"
    assert (running_on[2] - alone[2]).abs().max() > 1e-3, "without the documents the last one should change"


def test_float8_converts_the_layers_linears_and_keeps_the_head():
    """float8 on transformers' linears: every decoder layer's nn.Linear becomes torchao's Float8Linear; the head
    (``lm_head``, found as the model's ``output``, not by our families' name) stays in high precision."""
    from torchao.float8.float8_linear import Float8Linear

    from torchtitan.config.schema import Float8
    from torchtitan.features.float8.float8 import apply_float8

    model = build_meta_model(SPEC, dataclasses.replace(SPEC.flavors["mistral_tiny"], vocab_size=2048))
    converted = apply_float8(model, Float8(enable_float8_linear=True))
    linears = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert sorted(converted) == sorted(linears) and len(linears) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(model.hf.lm_head) is torch.nn.Linear
