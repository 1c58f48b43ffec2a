"""Logit parity with Hugging Face transformers on randomly initialised small models (fp32, CPU).

Each case builds the model with transformers (random init, saved with ``save_pretrained``), imports
it through the family's adapter, and compares our forward with theirs; then exports ours back and
loads that in transformers. Sequences run past RoPE scaling's original context, where scaled and
plain RoPE differ.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.convert import export_to_hf, import_from_hf
from torchtitan.models.llama.hf_adapter import ADAPTER
from torchtitan.models.llama.model import RopeScaling, Transformer
from torchtitan.models.qwen3.hf_adapter import QWEN3 as QWEN3_ADAPTER
from torchtitan.models.qwen3.hf_adapter import QWEN3_MOE as QWEN3_MOE_ADAPTER
from torchtitan.spec import get_model_spec

transformers = pytest.importorskip("transformers")

SEQ = 64
LLAMA31 = {
    "hidden_size": 64,
    "intermediate_size": 256,  # our SwiGLU width for dim 64 (multiple_of 256)
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    # Llama 3.1's scaling with a 16-token original context, so SEQ = 64 is well past it
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "tie_word_embeddings": False,
}


def _hf_model(tmp_path, config: dict, family: str = "Llama") -> str:
    torch.manual_seed(0)
    hf_cls, config_cls = getattr(transformers, f"{family}ForCausalLM"), getattr(transformers, f"{family}Config")
    model = hf_cls(config_cls(**config)).eval()
    folder = str(tmp_path / "hf_in")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _ours(args: dict, model_name: str = "llama3") -> Transformer:
    spec = get_model_spec(model_name)
    args_cls = type(next(iter(spec.flavors.values())))
    scaling = args.get("rope_scaling")
    fields = {f.name for f in dataclasses.fields(args_cls)}
    kwargs = {k: v for k, v in args.items() if k in fields and k != "rope_scaling"}
    model_args = args_cls(**kwargs, rope_scaling=RopeScaling(**scaling) if scaling else None)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


LLAMA32 = {**LLAMA31, "tie_word_embeddings": True, "rope_scaling": {**LLAMA31["rope_scaling"], "factor": 32.0}}


@pytest.mark.parametrize(
    "config",
    [LLAMA31, {**LLAMA31, "rope_scaling": None}, LLAMA32],
    ids=["llama3.1_rope_scaling", "plain_rope", "llama3.2_tied"],
)
def test_llama_import_and_export_match_transformers(tmp_path, config):
    scaled = config["rope_scaling"] is not None
    hf_dir = _hf_model(tmp_path, config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with open(os.path.join(hf_dir, "config.json")) as f:
        args = ADAPTER.model_args_from_hf(json.load(f))
    assert (args["rope_scaling"] is not None) == scaled
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed)
    weights, _ = load_model_weights(seed)
    ours = _ours(args)
    ours.load_state_dict(weights)
    tied = config["tie_word_embeddings"]
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, tokens), _logits(ours, tokens)
    delta = (got - want).abs().max().item()
    print(
        f"\nllama {'scaled' if scaled else 'plain'} RoPE{', tied' if tied else ''}, seq {SEQ}: max |dlogits| {delta:.2e}"
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if scaled:  # the scaling matters at this length: plain RoPE on the same weights is far off
        plain = _ours({**args, "rope_scaling": None})
        plain.load_state_dict(weights)
        assert (_logits(plain, tokens) - want).abs().max().item() > 1e3 * max(delta, 1e-7)
    out_dir = str(tmp_path / "hf_out")
    export_to_hf(seed, out_dir)
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert back.config.tie_word_embeddings == tied
    torch.testing.assert_close(_logits(back, tokens), got, rtol=1e-5, atol=1e-5)


QWEN3 = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # != hidden_size / heads = 16: Qwen3's own head_dim
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
}


@pytest.mark.parametrize("tied", [False, True], ids=["qwen3", "qwen3_tied"])
def test_qwen3_import_and_export_match_transformers(tmp_path, tied):
    """QK-norm (its weights reordered within each head like wq/wk's rows), head_dim of its own, tying."""
    config = {**QWEN3, "tie_word_embeddings": tied}
    hf_dir = _hf_model(tmp_path, config, family="Qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    # random-init RMSNorm weights are all ones; make the q/k norms' reordering visible
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(hf_dir, safe_serialization=True)
    with open(os.path.join(hf_dir, "config.json")) as f:
        args = QWEN3_ADAPTER.model_args_from_hf(json.load(f))
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed, model_name="qwen3")
    weights, _ = load_model_weights(seed)
    ours = _ours(args, "qwen3")
    ours.load_state_dict(weights)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, tokens), _logits(ours, tokens)
    print(f"\nqwen3{' tied' if tied else ''}, seq {SEQ}: max |dlogits| {(got - want).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out_dir = str(tmp_path / "hf_out")
    export_to_hf(seed, out_dir)
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM" and back.config.tie_word_embeddings == tied
    torch.testing.assert_close(_logits(back, tokens), got, rtol=1e-5, atol=1e-5)


QWEN3_MOE = {
    **{k: v for k, v in QWEN3.items() if k != "intermediate_size"},
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}


def test_qwen3_moe_import_and_export_match_transformers(tmp_path):
    """Per-expert HF weights stacked into our grouped experts, softmax top-k renormalised, QK-norm."""

    hf_dir = _hf_model(tmp_path, QWEN3_MOE, family="Qwen3Moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with open(os.path.join(hf_dir, "config.json")) as f:
        args = QWEN3_MOE_ADAPTER.model_args_from_hf(json.load(f))
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed, model_name="qwen3_moe")
    weights, _ = load_model_weights(seed)
    ours = _ours(args, "qwen3_moe")
    ours.load_state_dict(weights)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, tokens), _logits(ours, tokens)
    print(f"\nqwen3_moe, seq {SEQ}: max |dlogits| {(got - want).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out_dir = str(tmp_path / "hf_out")
    export_to_hf(seed, out_dir)
    back = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    torch.testing.assert_close(_logits(back, tokens), got, rtol=1e-5, atol=1e-5)
