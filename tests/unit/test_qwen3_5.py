"""Qwen3.5's text model (``model.name = "qwen3_5"``, and ``"qwen3_5_moe"``), in process: logits equal
transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` with the same weights; the chunked gated delta rule equals the token-by-token one; packed documents equal the
documents alone; the HF conversion round-trips; HF configs we do not build are refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support.qwen3_5 import VOCAB, tiny_qwen3_5
from torchtitan.checkpointing.hf.files import save_hf_folder
from torchtitan.models.qwen3_5.gated_delta import chunked_gated_delta_rule, recurrent_gated_delta_rule
from torchtitan.models.qwen3_5.hf_adapter import QWEN3_5, QWEN3_5_MOE
from torchtitan.spec import get_model_spec

SPEC = get_model_spec("qwen3_5")
ADAPTERS = {"qwen3_5": QWEN3_5, "qwen3_5_moe": QWEN3_5_MOE}


def _transformers(model, fields, folder, adapter=QWEN3_5):
    """transformers' model of our weights, read from the HF folder our adapter writes (its loader fuses the MoE's
    per-expert tensors, as for a published checkpoint)."""
    config = adapter.hf_config(fields, {}, torch.float32)
    save_hf_folder(adapter.to_hf_state_dict(model.state_dict(), fields), config, str(folder))
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_logits_equal_transformers(family, tmp_path):
    """40 tokens: the tiny flavor's chunk of 16 pads the last chunk (transformers' rule runs chunks of 64). The MoE:
    4 experts, top 2, and the gated shared expert."""
    model, fields = tiny_qwen3_5(family=family)
    theirs = _transformers(model, fields, tmp_path, ADAPTERS[family])
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, want = model(tokens), theirs(input_ids=tokens).logits
    gap = ((ours - want).abs().max() / want.abs().max()).item()
    assert gap <= 1e-5, gap


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_greedy_generation_equals_transformers(family, tmp_path, monkeypatch):
    """Greedy text with our cache (the attention's keys and values, each Gated DeltaNet layer's convolution inputs
    and state) equals transformers' generate with its own cache, and ours without a cache. The matrices are drawn
    at unit gain so the mixers, not the embedding alone, pick the tokens: forgetting the state between calls changes
    the text (the check can fail)."""
    from torchtitan.components.generation import generate
    from torchtitan.models.qwen3_5.gated_delta import GatedDeltaNet, RecurrentState

    model, fields = tiny_qwen3_5(family=family)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embeddings" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    theirs = _transformers(model, fields, tmp_path, ADAPTERS[family])
    prompt = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(3))
    ours = generate(model, prompt, 24, use_cache=True)
    want = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    assert torch.equal(ours, want), (ours[:, 21:].tolist(), want[:, 21:].tolist())
    assert torch.equal(ours, generate(model, prompt, 24, use_cache=False))
    carried = GatedDeltaNet._continue
    monkeypatch.setattr(GatedDeltaNet, "_continue", lambda self, *a: carried(self, *a[:-1], RecurrentState()))
    assert not torch.equal(ours, generate(model, prompt, 24, use_cache=True))


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


@pytest.mark.parametrize(("lengths", "chunk"), [((20, 9, 11), 8), ((16, 16, 5), 16), ((1, 30, 2, 7), 16), ((40,), 16)])
def test_chunked_rule_with_documents_equals_each_document_alone(lengths, chunk):
    """Documents packed in a row (several per chunk, one across chunks, boundaries on a chunk's edge, one-token
    documents) give each document's token-by-token outputs from a zero state, within 1e-6; so does the convolution."""
    from torchtitan.models.qwen3_5.gated_delta import causal_depthwise_conv

    gen = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    q, k = (torch.randn(2, total, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, total, 4, 6, generator=gen)
    g, beta = -torch.rand(2, total, 4, generator=gen) * 2, torch.rand(2, total, 4, generator=gen)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).expand(2, -1)
    got = chunked_gated_delta_rule(q, k, v, g, beta, chunk, doc_ids=doc_ids)[0].split(lengths, dim=1)
    parts = zip(*(t.split(lengths, dim=1) for t in (q, k, v, g, beta)))
    for i, (got_i, part) in enumerate(zip(got, parts)):
        want = recurrent_gated_delta_rule(*part)[0]
        assert (got_i - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item()), f"document {i}"
    x, weight = torch.randn(2, total, 6, generator=gen), torch.randn(6, 4, generator=gen)
    convolved = causal_depthwise_conv(x, weight, doc_ids).split(lengths, dim=1)
    for got_i, x_i in zip(convolved, x.split(lengths, dim=1)):
        torch.testing.assert_close(got_i, causal_depthwise_conv(x_i, weight), rtol=1e-6, atol=1e-6)


def test_compiled_blocks_with_documents_equal_eager():
    """block_causal under training.compile: every block compiled whole (fullgraph, as the trainer does: any host
    read of the document ids would break the graph and fail here) gives eager's logits and gradients. The eager
    backend runs dynamo's graph without code generation (inductor on the two block kinds: ~45 s of CPU, run by
    hand: the same numbers)."""
    model, _ = tiny_qwen3_5()
    lengths = (20, 9, 11)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(2, -1)
    eager = model(tokens, positions, doc_ids=doc_ids)
    eager.square().mean().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True, backend="eager")
    compiled = model(tokens, positions, doc_ids=doc_ids)
    compiled.square().mean().backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name.replace("._orig_mod", "")], rtol=1e-4, atol=1e-7)


def test_packed_documents_equal_documents_alone():
    """block_causal: three documents packed in a row (per-document positions) give each document's logits alone:
    no Gated DeltaNet state or convolution history crosses a boundary; without the documents the later ones
    change (the check can fail)."""
    model, _ = tiny_qwen3_5()
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


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_hf_conversion_round_trips(family):
    """Bit-exact both ways; a published multimodal folder's layout (the language model under
    ``model.language_model.``, a vision tower and an MTP layer beside it) reads as the same weights."""
    model, fields = tiny_qwen3_5(family=family)
    adapter = ADAPTERS[family]
    ours = model.state_dict()
    hf = adapter.to_hf_state_dict(ours, fields)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in hf and "model.layers.3.self_attn.q_proj.weight" in hf
    back = adapter.from_hf_state_dict(hf, fields)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    multimodal = {k.replace("model.", "model.language_model.", 1): w for k, w in hf.items()}
    multimodal |= {"model.visual.blocks.0.attn.qkv.weight": torch.ones(2), "mtp.fc.weight": torch.ones(2)}
    back = adapter.from_hf_state_dict(multimodal, fields)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    config = adapter.hf_config(fields, ours, torch.float32)
    read = adapter.model_args_from_hf(config)
    assert {k: fields[k] for k in read} == read
    nested = {"model_type": family, "text_config": config, "vision_config": {"depth": 2}}
    assert adapter.model_args_from_hf(nested) == read


@pytest.mark.parametrize(
    ("layer_types", "expected"),
    [
        (["linear_attention", "mamba", "linear_attention", "full_attention"], "layer_types has ['mamba']"),
        (["full_attention", "linear_attention", "linear_attention", "full_attention"], "at every k-th layer"),
    ],
)
def test_hf_configs_we_do_not_build_are_refused_in_one_line(layer_types, expected):
    _, fields = tiny_qwen3_5()
    config = {**QWEN3_5.hf_config(fields, {}, torch.float32), "layer_types": layer_types}
    with pytest.raises(NotImplementedError) as info:
        QWEN3_5.model_args_from_hf(config)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("family", "flavor"),
    [
        *(("qwen3_5", f) for f in ("0.8B", "2B", "4B", "9B", "27B")),
        *(("qwen3_5_moe", f) for f in ("35B-A3B", "122B-A10B", "397B-A17B")),
    ],
)
def test_published_flavors_have_transformers_parameter_count(family, flavor):
    """Each published flavor built on the meta device has as many parameters as transformers' model of the config
    our adapter writes for it (a tied head counted once)."""
    spec = get_model_spec(family)
    args = spec.flavors[flavor]
    with torch.device("meta"):
        ours = spec.model_cls(dataclasses.replace(args, max_seq_len=16))
        config = ADAPTERS[family].hf_config(dataclasses.asdict(args), {}, torch.float32)
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


def test_fla_kernel_gets_the_torch_rules_contract(monkeypatch):
    """model.linear_attention_kernel: 'auto' is torch on the CPU and fla on CUDA where installed; 'fla' without CUDA
    or the package is refused in one line. With 'fla' every Gated DeltaNet layer calls flash-linear-attention's
    chunk_gated_delta_rule (here a stand-in module computing the token-by-token rule, as the package is GPU-only)
    with [B, T, H, K] inputs, q/k repeated to the value heads, its own L2 norm and the final state asked for; the
    logits equal the torch form's."""
    import importlib.machinery
    import sys
    import types

    import torchtitan.models.qwen3_5.kernels as kernels
    from torchtitan.models.qwen3_5.kernels import install_linear_attention_kernel, resolve_linear_attention_kernel

    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_linear_attention_kernel("fla", "cpu")
    with monkeypatch.context() as m:
        m.setattr(kernels, "fla_installed", lambda: False)
        with pytest.raises(ValueError, match="flash-linear-attention is not installed; pip install"):
            resolve_linear_attention_kernel("fla", "cuda")
        assert resolve_linear_attention_kernel("auto", "cuda") == "torch"

    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, **flags):
        """fla's contract: [B, T, H, K] inputs, documents as one row cut at ``cu_seqlens``."""
        calls.append((q.shape, v.shape, output_final_state))
        bounds = flags.pop("cu_seqlens", None)
        assert q.shape[:3] == v.shape[:3] and flags == {"use_qk_l2norm_in_kernel": True} and g.dtype == torch.float32
        if bounds is None:
            return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state)
        assert q.shape[0] == 1 and bounds.dtype == torch.long and bounds[-1] == q.shape[1]
        parts = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        outs = [recurrent_gated_delta_rule(*(t[:, a:b] for t in (q, k, v, g, beta)))[0] for a, b in parts]
        return torch.cat(outs, dim=1), None

    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.chunk_gated_delta_rule = chunk_gated_delta_rule
        monkeypatch.setitem(sys.modules, name, module)
    assert resolve_linear_attention_kernel("auto", "cuda") == "fla"
    assert resolve_linear_attention_kernel("auto", "cpu") == "torch"
    model, _ = tiny_qwen3_5()
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
        install_linear_attention_kernel(model, "fla", torch.device("cuda"))  # the device's type is all it reads
        got = model(tokens)
    assert len(calls) == 3 and all(c[0] == (2, 40, 4, 16) and c[2] for c in calls), calls  # 3 layers, 4 value heads
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    lengths = (20, 9, 11)  # documents: one row of 80 tokens cut into 6 (each row starts one too)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(2, -1)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(2, -1)
    with torch.no_grad():
        got = model(tokens, positions, doc_ids=doc_ids)
        model.layers.apply(
            lambda m: setattr(m, "chunk_rule", chunked_gated_delta_rule) if hasattr(m, "chunk_rule") else 0
        )
        want = model(tokens, positions, doc_ids=doc_ids)
    assert calls[-1][0] == (1, 80, 4, 16) and (got - want).abs().max() <= 1e-5 * want.abs().max()
