"""gpt-oss (models/gpt_oss): logit parity with transformers' ``GptOssForCausalLM`` (import and export), the
attention-sink identity, block-causal documents, the published sizes, and the refusals of what does not compose.

The HF model is random-init, fp32, eager attention, with a sliding window shorter than the sequence (both layer
kinds matter), nonzero sinks and biases, experts large enough that SwiGLU's clamps bite, and YaRN from a
16-token original context.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.support.published import GPT_OSS_PUBLISHED
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.convert import export_to_hf, import_from_hf
from torchtitan.config.manager import JobConfig
from torchtitan.models.common.documents import document_positions
from torchtitan.models.gpt_oss import GptOssArgs, GptOssTransformer, apply_sinks, gpt_oss_configs
from torchtitan.models.gpt_oss.hf_adapter import ADAPTER
from torchtitan.models.gpt_oss.model import attention_mask, masked_attention_with_lse
from torchtitan.models.gpt_oss.moe import GptOssExperts
from torchtitan.spec import get_model_spec

transformers = pytest.importorskip("transformers")

SEQ = 64
TINY_HF = {
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 4,  # sliding, full, sliding, full
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "sliding_window": 8,  # < SEQ
    "max_position_embeddings": 128,  # = factor * original, as transformers expects of YaRN
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
}


def _hf_folder(tmp_path) -> str:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY_HF))
    with torch.no_grad():  # transformers inits biases to 0 and sinks near 0; make every one of them count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks", "gate_up_proj", "down_proj")):
                p.normal_(0.0, 0.5)  # experts at std 0.5: some gate/up pre-activations pass the clamp (7)
    folder = str(tmp_path / "hf_in")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _load_hf(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _ours(args: GptOssArgs, weights: dict | None = None) -> GptOssTransformer:
    with torch.device("meta"):
        model = GptOssTransformer(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    if weights is None:
        torch.manual_seed(0)
        model.init_weights()
    else:
        model.load_state_dict(weights)
    return model.eval()


def _logits(model, tokens, **kwargs):
    with torch.no_grad():
        out = model(tokens, **kwargs)
    return out.logits if hasattr(out, "logits") else out


def test_import_and_export_match_transformers(tmp_path):
    folder = _hf_folder(tmp_path)
    hf = _load_hf(folder)
    with open(os.path.join(folder, "config.json")) as f:
        args = GptOssArgs.from_dict(ADAPTER.model_args_from_hf(json.load(f)))
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(folder, seed)  # the family from config.json's model_type
    weights, _ = load_model_weights(seed)
    ours = _ours(args, weights)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, tokens), _logits(ours, tokens)
    delta = (got - want).abs().max().item()
    print(f"\ngpt_oss, seq {SEQ}, window 8, YaRN: max |dlogits| {delta:.2e} (logits up to {want.abs().max():.2f})")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each feature moves the logits far more than the parity gap: full attention everywhere, no sinks
    for other in (dataclasses.replace(args, full_attention_every=1), dataclasses.replace(args, yarn=None)):
        assert (_logits(_ours(other, weights), tokens) - want).abs().max() > 1e3 * max(delta, 1e-7)
    no_sinks = {k: (torch.full_like(v, -1e4) if k.endswith("sinks") else v) for k, v in weights.items()}
    assert (_logits(_ours(args, no_sinks), tokens) - want).abs().max() > 1e3 * max(delta, 1e-7)

    out_dir = str(tmp_path / "hf_out")
    export_to_hf(seed, out_dir)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(back).__name__ == "GptOssForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(_logits(back.eval(), tokens), want, rtol=1e-5, atol=1e-5)


def test_documents_equal_running_each_document_alone():
    args = dataclasses.replace(gpt_oss_configs["debugmodel_tiny"], vocab_size=128, max_seq_len=SEQ)
    model = _ours(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks", ".b1", ".b2", ".b3")):
                p.normal_(0.0, 0.5)
    lengths = [[20, 30, 14], [40, 24]]  # documents longer than the 16-token window
    doc_ids = torch.tensor([sum(([d] * n for d, n in enumerate(row)), []) for row in lengths])  # (2, SEQ)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(2))
    packed = _logits(model, tokens, positions=document_positions(doc_ids), doc_ids=doc_ids)  # (2, SEQ, vocab)
    for b, row in enumerate(lengths):
        for doc, chunk in zip(range(len(row)), tokens[b].split(row)):
            alone = _logits(model, chunk[None])[0]  # (n, vocab), positions 0..n-1
            torch.testing.assert_close(packed[b, doc_ids[b] == doc], alone, rtol=1e-5, atol=1e-5)


def test_apply_sinks_equals_a_softmax_with_the_sink_logit_values_and_gradients():
    bs, n_heads, n_kv_heads, s, d = 2, 4, 2, 12, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(bs, h, s, d, generator=gen, requires_grad=True) for h in (n_heads, n_kv_heads, n_kv_heads))
    sinks = torch.randn(n_heads, generator=gen, requires_grad=True)
    doc_ids = torch.tensor([[0] * 7 + [1] * 5, [0] * 12])
    mask = attention_mask(s, 4, doc_ids, q.device)  # (bs, 1, s, s): causal, window 4, documents
    out, lse = masked_attention_with_lse(q, k, v, mask)
    got = apply_sinks(out, lse, sinks)
    # the reference: transformers' eager attention, the sink as one more logit per row, dropped after softmax
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(-1, -2) * d**-0.5).masked_fill(~mask, float("-inf"))  # (bs, h, s, s)
    with_sink = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(bs, -1, s, 1)], dim=-1)
    want = with_sink.softmax(dim=-1)[..., :-1] @ vv
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v, sinks))
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v, sinks))):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_grouped_and_looped_experts_agree():
    args = dataclasses.replace(gpt_oss_configs["debugmodel_tiny"], num_experts=4)
    torch.manual_seed(0)
    grouped = GptOssExperts(args)
    grouped.init_weights(0.5)
    with torch.no_grad():
        for p in grouped.parameters():
            p.normal_(0.0, 0.5)
    looped = GptOssExperts(dataclasses.replace(args, use_grouped_mm=False))
    looped.load_state_dict(grouped.state_dict())
    x, counts = torch.randn(10, args.dim), torch.tensor([3, 0, 5, 2])
    torch.testing.assert_close(grouped(x, counts), looped(x, counts), rtol=1e-5, atol=1e-5)


EXACT = {"20B": 20_914_757_184, "120B": 116_829_156_672}


@pytest.mark.parametrize("flavor", ["20B", "120B"])
def test_published_sizes_and_configs_match_transformers(flavor):
    args = gpt_oss_configs[flavor]
    with torch.device("meta"):
        ours = GptOssTransformer(args)
        hf_config = {k: v for k, v in GPT_OSS_PUBLISHED[flavor].items() if k not in ("architectures", "model_type")}
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**hf_config))
    count = sum(p.numel() for p in ours.parameters())
    print(f"\ngpt_oss {flavor}: {count:,} parameters (transformers {sum(p.numel() for p in hf.parameters()):,})")
    assert count == sum(p.numel() for p in hf.parameters()) == EXACT[flavor]
    # the published config.json converts to exactly this flavor (what initial_load_in_hf checks)
    converted, flavor_dict = ADAPTER.model_args_from_hf(GPT_OSS_PUBLISHED[flavor]), dataclasses.asdict(args)
    assert {k: v for k, v in converted.items() if flavor_dict[k] != v} == {}


def test_args_dicts_saved_before_yarn_was_shared_load_as_the_same_args():
    """Checkpoint markers hold ``dataclasses.asdict(args)``; gpt-oss's YarnScaling had no mscale fields then."""
    for args in gpt_oss_configs.values():
        assert GptOssArgs.from_dict(dataclasses.asdict(args)) == args
    tiny = gpt_oss_configs["debugmodel_tiny"]
    yarn = {"factor": 32.0, "original_max_seq_len": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    assert GptOssArgs.from_dict({**dataclasses.asdict(tiny), "yarn": yarn}) == tiny


def _config(*overrides: str) -> JobConfig:
    return JobConfig.parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--model.name", "gpt_oss", *overrides]
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["--experimental.context_parallel_degree", "2", "--experimental.context_parallel_impl", "torch"],
            "torch's ring attention has no attention sinks",
        ),
    ],
)
def test_layouts_that_do_not_compose_yet_are_refused(monkeypatch, overrides, match):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = get_model_spec("gpt_oss")

    def check(config: JobConfig) -> list[str]:
        sections = dict(model=config.model, training=config.training, experimental=config.experimental)
        return spec.check_fn(spec.flavors["debugmodel"], **sections)

    assert check(_config()) == []
    assert check(_config("--experimental.context_parallel_degree", "2")) == []  # our ring: sinks and windows
    with pytest.raises(NotImplementedError, match=match):
        check(_config(*overrides))
