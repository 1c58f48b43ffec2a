"""DeepSeek-V3.2 ("deepseek_v32"): logit parity with transformers' DeepseekV32ForCausalLM (import and export), greedy
text through scripts/generate.py --hf equal to transformers' generate, the KV cache's sparse decoding equal to a full
forward, the indexer loss and its stages, and the refusals.

The parity model is a random-init transformers model (fp32, CPU) with weights at std 0.1 and its norms and the
indexer's LayerNorm drawn away from 1 / 0, so the indexer's choice is far from arbitrary; its ``index_topk`` (8) is
an eighth of the 64 tokens, so most keys are left out (checked to matter below).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.convert import export_to_hf, import_from_hf
from torchtitan.components.generation import KVCache
from torchtitan.models.deepseek_v32 import DeepSeekV32Args, DeepSeekV32Transformer, deepseek_v32_configs
from torchtitan.models.deepseek_v32.hf_adapter import ADAPTER
from torchtitan.models.deepseek_v32.indexer import compute_indexer_loss

transformers = pytest.importorskip("transformers")

SEQ = 64
HF_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "index_n_heads": 16,  # ties (every head's relu 0) rare: topk's order among them depends on the row length
    "index_head_dim": 16,
    "index_topk": 8,
    "max_position_embeddings": SEQ,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


def _hf_folder(tmp_path, config: dict) -> str:
    """A random-init DeepseekV32ForCausalLM saved by transformers, its norms and correction bias made non-trivial."""
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("k_norm.bias"):
                p.uniform_(-0.5, 0.5)
        for layer in model.model.layers[config["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    folder = str(tmp_path / f"hf_{config['vocab_size']}")
    model.save_pretrained(folder)
    return folder


def _import(tmp_path, hf_dir: str) -> tuple[dict, dict, str]:
    with open(os.path.join(hf_dir, "config.json")) as f:
        args = ADAPTER.model_args_from_hf(json.load(f))
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed, model_name="deepseek_v32")
    return args, load_model_weights(seed)[0], seed


def _ours(args: dict, weights: dict) -> DeepSeekV32Transformer:
    with torch.device("meta"):
        model = DeepSeekV32Transformer(DeepSeekV32Args.from_dict(args))
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(weights)
    return model.eval()


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_import_and_export_match_transformers(tmp_path):
    hf_dir = _hf_folder(tmp_path, HF_CONFIG)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    args, weights, seed = _import(tmp_path, hf_dir)
    assert weights["layers.1.attention.indexer.k_norm.bias"].abs().sum() > 0
    ours = _ours(args, weights)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, tokens), _logits(ours, tokens)
    print(f"\ndeepseek_v32 seq {SEQ}, top {HF_CONFIG['index_topk']}: max relative |dlogits| {_relative(got, want):.2e}")
    assert _relative(got, want) <= 1e-5
    # the indexer matters: all keys (dense), or another choice of 8, moves the logits
    dense = _ours({**args, "index_topk": SEQ}, weights)
    assert _relative(_logits(dense, tokens), want) > 1e-2
    out_dir = str(tmp_path / "hf_out")
    export_to_hf(seed, out_dir)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(back).__name__ == "DeepseekV32ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert _relative(_logits(back.eval(), tokens), got) <= 1e-5


@torch.no_grad()
def test_cached_sparse_decoding_equals_a_full_forward():
    """Each decoding step's top-k over the cached indexer keys equals the full forward's, past index_topk tokens."""
    args = dataclasses.replace(
        deepseek_v32_configs["debugmodel_tiny"], vocab_size=128, max_seq_len=32, index_topk=8, index_n_heads=16
    )
    torch.manual_seed(0)
    model = DeepSeekV32Transformer(args)
    model.init_weights()
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    cache = KVCache(32)
    swapped = cache.install(model)
    try:
        cached = [model(tokens[:, :16])]
        cache.length = 16
        for t in range(16, 32):
            cached.append(model(tokens[:, t : t + 1], torch.arange(t, t + 1)))
            cache.length = t + 1
    finally:
        KVCache.uninstall(swapped)
    delta = (torch.cat(cached, dim=1) - full).abs().max().item()
    print(f"deepseek_v32: max |dlogits| cached vs full {delta:.1e}")
    assert delta <= 1e-4, delta


def test_generate_script_greedy_text_equals_transformers(tmp_path, capsys):
    """scripts/generate.py --hf (our model, our KV cache with the indexer's keys) prints transformers' greedy text;
    24 new tokens after a 10-token prompt, each query keeping 8 keys."""
    from tests.support.scripts import generate_script

    script = generate_script()
    hf_dir = _hf_folder(tmp_path, {**HF_CONFIG, "vocab_size": 2304})  # the shipped tokenizer's words
    argv = ["--hf", hf_dir, "--prompt", "def main(args):\n    return", "--max_new_tokens", "24"]
    assert script.main(argv) == 0
    printed = capsys.readouterr().out
    parsed = script._parser().parse_args(argv)
    parsed.tokenizer = script.default_tokenizer(hf_dir, None)
    prompt = script.build_prompt(parsed)
    assert len(prompt.ids) > HF_CONFIG["index_topk"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt.ids])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=prompt.stop_ids[0]
    )
    want = prompt.to_text(out[0, len(prompt.ids) :].tolist())
    print(f"greedy: {want!r}")
    assert len(set(out[0, len(prompt.ids) :].tolist())) > 3  # not one token repeated: the attention picks them
    assert printed == want + "\n"


def test_indexer_loss_is_the_kl_to_the_main_attention_over_the_kept_keys():
    """KL(p || softmax(I)) per query, p the mean over heads of the main attention over the kept keys: computed here
    key by key; an indexer whose scores are log p (on the kept keys) has loss 0."""
    gen = torch.Generator().manual_seed(0)
    bs, heads, n, d = 2, 3, 6, 4
    q, k = torch.randn(bs, heads, n, d, generator=gen), torch.randn(bs, heads, n, d, generator=gen)
    scores = torch.randn(bs, n, n, generator=gen)
    keep = torch.rand(bs, n, n, generator=gen) < 0.6
    keep |= torch.eye(n, dtype=torch.bool)  # every query keeps at least itself
    got = compute_indexer_loss(scores, q, k, keep)
    total = 0.0
    for b in range(bs):
        for s in range(n):
            cols = keep[b, s].nonzero().flatten()
            p = torch.stack([(q[b, h, s] @ k[b, h, cols].T * d**-0.5).softmax(-1) for h in range(heads)]).mean(0)
            total += (p * (p.log() - scores[b, s, cols].log_softmax(-1))).sum()
    torch.testing.assert_close(got, total / (bs * n), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logits = (q @ k.transpose(-1, -2) * d**-0.5).masked_fill(~keep.unsqueeze(1), float("-inf"))
        target = logits.softmax(-1).mean(1).log()  # (bs, n, n)
    assert compute_indexer_loss(target, q, k, keep).abs() < 1e-6


def _tiny(**fields) -> DeepSeekV32Transformer:
    args = dataclasses.replace(deepseek_v32_configs["debugmodel_tiny"], vocab_size=64, max_seq_len=32, **fields)
    torch.manual_seed(0)
    model = DeepSeekV32Transformer(args)
    model.init_weights()
    return model


def test_the_sparse_stage_trains_the_model_on_the_lm_loss_and_the_indexer_on_its_own():
    model = _tiny(index_topk=8)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    model(tokens).logsumexp(-1).mean().backward()  # a stand-in for the LM loss
    indexer = {n for n, p in model.named_parameters() if ".indexer." in n}
    assert indexer and all(p.grad is None for n, p in model.named_parameters() if n in indexer)
    assert all(p.grad is not None for n, p in model.named_parameters() if n not in indexer and "layers.0." in n)
    model.zero_grad(set_to_none=True)
    model(tokens)
    model.indexer_loss().backward()
    assert {n for n, p in model.named_parameters() if p.grad is not None} == indexer
    assert model.indexer_loss() == 0  # taken by the first call


def test_the_indexer_loss_hook_adds_the_term_and_logs_its_mean_over_micro_batches():
    from torchtitan.models.deepseek_v32.spec import IndexerLoss

    model = _tiny(index_topk=8)
    world = type("World", (), {"group": lambda self, name: None})()  # one process: no data-parallel group
    hooks = IndexerLoss(world, torch.device("cpu"))
    terms = []
    for seed in (1, 2):  # two micro-batches of one step, each at scale 1/2
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(seed))
        model(tokens)
        kernels = [m.attention.sdpa for m in model.layers.values()]
        want = model.args.indexer_loss_coeff * torch.stack([k.indexer_loss for k in kernels]).sum()
        got = hooks.aux_loss(model, 0.5)
        torch.testing.assert_close(got, want * 0.5, rtol=0, atol=0)
        terms.append(want.item())
    hooks.reduce_step(keep_metrics=True, outer_sum=None)
    fields, scalars = hooks.metrics()
    assert fields["indexer_loss"] == pytest.approx(sum(terms) / 2, rel=1e-12) and terms[0] != terms[1]
    assert scalars == {"loss_metrics/indexer_loss": fields["indexer_loss"]}
    assert hooks.metrics() is None  # taken
    hooks.reduce_step(keep_metrics=False, outer_sum=None)  # an empty step that logs nothing
    assert hooks.metrics() is None


def test_the_dense_warmup_attends_densely_and_trains_only_the_indexers():
    warmup = _tiny(index_topk=8, dsa_stage="dense_warmup")
    dense = _tiny(index_topk=32)  # the same weights (same seed), every key kept
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(warmup(tokens), dense(tokens))
    trainable = [p for p in warmup.parameters() if p.requires_grad]
    assert {n for n, p in warmup.named_parameters() if p.requires_grad} == {
        n for n in dict(warmup.named_parameters()) if ".indexer." in n
    }
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    losses = []
    for _ in range(8):
        warmup(tokens)
        loss = warmup.indexer_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    print(f"dense warm-up indexer loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"index_topk": 0}, "DeepSeekV32Args.index_topk = 0 is invalid: use >= 1"),
        ({"dsa_stage": "warmup"}, "DeepSeekV32Args.dsa_stage = 'warmup' is invalid: use one of sparse, dense_warmup"),
        ({"index_head_dim": 4}, "RoPE rotates its first qk_rope_head_dim = 8 dims"),
        ({"q_lora_rank": 0}, "the indexer reads the q latent"),
    ],
)
def test_bad_args_end_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(deepseek_v32_configs["debugmodel_tiny"], **fields)


def _config(*args: str):
    from torchtitan.config.manager import JobConfig

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return JobConfig.parse_args(
        ["--job.config_file", os.path.join(root, "train_configs/deepseek_v32_debug.toml"), *args]
    )


def test_preflight_accepts_the_debug_config_and_refuses_what_dsa_cannot_run_under():
    from torchtitan.config.errors import ConfigError
    from torchtitan.preflight import run_preflight

    assert run_preflight(_config(), 1, this_machine=False) == []
    assert run_preflight(_config("--experimental.expert_parallel_degree", "2"), 2, this_machine=False) == []
    refused = {
        "context_parallel_degree = 2 .* DSA's top-k runs over the indexer's scores of the whole sequence": (
            "--experimental.context_parallel_degree",
            "2",
        ),
        "tensor_parallel_degree = 2 .* the indexer's heads have no TP plan": (
            "--training.tensor_parallel_degree",
            "2",
            "--experimental.expert_parallel_degree",
            "2",
        ),
        "pipeline_parallel_degree = 2": ("--experimental.pipeline_parallel_degree", "2"),
    }
    for message, argv in refused.items():
        with pytest.raises(NotImplementedError, match=message):
            run_preflight(_config(*argv), 2, this_machine=False)
    short = ("--training.seq_len", "32", "--model.flavor", "debugmodel")
    with pytest.raises(ConfigError) as refused:
        run_preflight(_config(*short), 1, this_machine=False)
    assert str(refused.value).count("\n") == 0
    assert "index_topk = 64 >= training.seq_len = 32: every query would keep every causal key" in str(refused.value)
    assert "debugmodel_tiny (16)" in str(refused.value)  # the flavor whose top-k fits, named
    assert run_preflight(_config(*short, "--model.dsa_stage", "dense_warmup"), 1, this_machine=False) == []


def test_model_dsa_stage_sets_the_stage_and_is_refused_elsewhere():
    from torchtitan.config.errors import ConfigError
    from torchtitan.preflight import run_preflight
    from torchtitan.spec import flavor_args

    assert flavor_args(_config().model).dsa_stage == "sparse"
    assert flavor_args(_config("--model.dsa_stage", "dense_warmup").model).dsa_stage == "dense_warmup"
    with pytest.raises(
        ConfigError, match="model.dsa_stage = 'dense_warmup' with model.name = 'deepseek_v3': the family"
    ):
        run_preflight(
            _config("--model.name", "deepseek_v3", "--model.dsa_stage", "dense_warmup"), 1, this_machine=False
        )


def test_the_hf_import_refuses_what_it_cannot_build():
    with pytest.raises(NotImplementedError, match="q_lora_rank = None: DeepSeek-V3.2's attention and indexer read"):
        ADAPTER.model_args_from_hf({**HF_CONFIG, "q_lora_rank": None})
    layers = ["dense", "sparse", "dense"]
    with pytest.raises(NotImplementedError, match=r"mlp_layer_types = \['dense', 'sparse', 'dense'\]"):
        ADAPTER.model_args_from_hf({**HF_CONFIG, "mlp_layer_types": layers})


def test_block_causal_equals_each_document_alone():
    """Each query's top-k runs over its own document's past only, with positions restarting per document."""
    from torchtitan.models.common.documents import document_ids, document_positions

    model = _tiny(index_topk=4).eval()
    eos = 3
    tokens = torch.randint(4, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    tokens[0, [6, 15]], tokens[1, 10] = eos, eos  # row 0: documents of 7, 9, 8; row 1: 11, 13
    doc_ids = document_ids(tokens, eos)
    with torch.no_grad():
        got = model(tokens, document_positions(doc_ids), doc_ids=doc_ids)
        for row in range(2):
            for doc in doc_ids[row].unique():
                cols = (doc_ids[row] == doc).nonzero().flatten()
                alone = model(tokens[row : row + 1, cols])
                torch.testing.assert_close(got[row : row + 1, cols], alone, rtol=1e-5, atol=1e-5)
        assert (got - model(tokens)).abs().max() > 1e-3


def test_671b_size_equals_transformers_of_the_published_config():
    from tests.support.published import DSV3_PUBLISHED

    mla = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    dsa = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
    with torch.device("meta"):
        hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**DSV3_PUBLISHED["671B"], **mla, **dsa))
        ours = DeepSeekV32Transformer(deepseek_v32_configs["671B"])
    total = sum(p.numel() for p in ours.parameters())
    print(f"\n671B: ours {total:,}, transformers {sum(p.numel() for p in hf.parameters()):,}")
    assert total == sum(p.numel() for p in hf.parameters())
