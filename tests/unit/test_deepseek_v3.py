"""DeepSeek-V3 ("deepseek_v3"): logit parity with transformers' DeepseekV3ForCausalLM (import and export),
group-limited routing, document masking, published sizes and the pre-launch check.

The parity models are random-init transformers models (fp32, CPU) with weights at std 0.1, so attention
is far from uniform and every feature moves the logits: YaRN's frequencies, attention factor and
softmax scale, the correction bias, the expert groups (each is checked to matter below).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.support.published import DSV3_PUBLISHED
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.convert import export_to_hf, import_from_hf
from torchtitan.checkpointing.hf.files import hf_folder_args
from torchtitan.config.manager import JobConfig
from torchtitan.models.common.documents import document_ids, document_positions
from torchtitan.models.common.rope.yarn import yarn_attention_factor
from torchtitan.models.deepseek_v3 import DeepSeekV3Args, DeepSeekV3Transformer, YarnScaling, deepseek_v3_configs
from torchtitan.models.deepseek_v3.hf_adapter import ADAPTER
from torchtitan.models.moe.moe import TokenChoiceRouter, compute_aux_loss, compute_sequence_aux_loss
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec, hf_conversion_refusal

transformers = pytest.importorskip("transformers")

SEQ = 64
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# q bottleneck, YaRN from a 16-token context (mscale != mscale_all_dim: an attention factor != 1),
# 8 experts in 2 groups (top 2 within the best group), one shared expert, layer 0 dense.
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
    "v_head_dim": 12,  # != qk_head_dim 24
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
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
# the other branches: q straight from x, plain RoPE, two shared experts' width, no groups
HF_PLAIN = {
    **HF_CONFIG,
    "q_lora_rank": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "n_shared_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 3,
}


def _hf_folder(tmp_path, config: dict) -> str:
    """A random-init DeepseekV3ForCausalLM saved by transformers, its norms and correction bias made non-trivial."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        for layer in model.model.layers[config["first_k_dense_replace"] :]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    folder = str(tmp_path / "hf_in")
    model.save_pretrained(folder)
    return folder


def _ours(args: dict, weights: dict) -> DeepSeekV3Transformer:
    with torch.device("meta"):
        model = DeepSeekV3Transformer(DeepSeekV3Args.from_dict(args))
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(weights)
    return model.eval()


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("config", [HF_CONFIG, HF_PLAIN], ids=["q_lora_yarn_groups", "q_proj_plain_rope_shared2"])
def test_import_and_export_match_transformers(tmp_path, config):
    hf_dir = _hf_folder(tmp_path, config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    args = hf_folder_args(hf_dir, ADAPTER)  # transformers writes num_nextn_predict_layers 1 and no MTP layer: 0 held
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed, model_name="deepseek_v3")
    weights, _ = load_model_weights(seed)
    assert weights["layers.1.feed_forward.expert_bias"].abs().sum() > 0  # HF's e_score_correction_bias
    ours = _ours(args, weights)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    want, got = _logits(hf, tokens), _logits(ours, tokens)
    delta = (got - want).abs().max().item()
    print(
        f"\ndeepseek_v3 {config['q_lora_rank'] and 'q_lora'}, seq {SEQ}: max |dlogits| {delta:.2e} (logits up to "
        f"{want.abs().max().item():.2f})"
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    out_dir = str(tmp_path / "hf_out")
    export_to_hf(seed, out_dir)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, output_loading_info=True
    )
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(_logits(back.eval(), tokens), got, rtol=1e-5, atol=1e-5)


def test_each_feature_moves_the_parity_logits(tmp_path):
    """Guards the parity test: dropping YaRN's softmax scale, the groups or the bias changes the logits."""
    hf_dir = _hf_folder(tmp_path, HF_CONFIG)
    args = hf_folder_args(hf_dir, ADAPTER)  # transformers writes num_nextn_predict_layers 1 and no MTP layer: 0 held
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed, model_name="deepseek_v3")
    weights, _ = load_model_weights(seed)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    reference = _logits(_ours(args, weights), tokens)
    yarn = args["rope_scaling"]
    factor = yarn_attention_factor(YarnScaling(**yarn))  # kept while the softmax scale goes
    variants = {
        "no softmax mscale": {**args, "rope_scaling": {**yarn, "mscale_all_dim": 0.0, "attention_factor": factor}},
        "plain RoPE": {**args, "rope_scaling": None},
        "no groups": {**args, "num_expert_groups": 1, "top_k_groups": 1},
    }
    for name, changed in [*variants.items(), ("no bias", args)]:
        w = weights if name != "no bias" else {k: v * ("expert_bias" not in k) for k, v in weights.items()}
        assert (_logits(_ours(changed, w), tokens) - reference).abs().max() > 1e-2, name


def test_group_limited_router_equals_transformers():
    """Sigmoid scores, bias for the choice only, top 2 groups of 4 by their two best, normalised, times 2.5."""
    config = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    ours = TokenChoiceRouter(16, 16, 4, "sigmoid", True, num_groups=4, top_k_groups=2, route_scale=2.5)
    torch.manual_seed(0)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.e_score_correction_bias.uniform_(-0.2, 0.2)
        ours.gate.weight.copy_(theirs.weight)
    x = torch.randn(64, 16)
    _, want_weights, want_experts = theirs(x)
    weights, experts, _ = ours(x, theirs.e_score_correction_bias)
    order, want_order = experts.sort(dim=-1), want_experts.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(-1, order.indices), want_weights.gather(-1, want_order.indices))
    plain = TokenChoiceRouter(16, 16, 4, "sigmoid", True, route_scale=2.5)
    plain.gate.weight.data.copy_(theirs.weight)
    assert not torch.equal(plain(x, theirs.e_score_correction_bias)[1].sort(-1).values, order.values)


def test_sequence_aux_loss_is_the_mean_of_per_sequence_losses():
    scores = torch.rand(3, 5, 4)
    experts = scores.topk(2, dim=-1).indices  # (bs, seqlen, top_k)
    per_row = [compute_aux_loss(s, torch.bincount(e.flatten(), minlength=4), 2) for s, e in zip(scores, experts)]
    torch.testing.assert_close(compute_sequence_aux_loss(scores, experts, 2), torch.stack(per_row).mean())


def _tiny(**fields) -> DeepSeekV3Args:
    return dataclasses.replace(deepseek_v3_configs["debugmodel_tiny"], vocab_size=64, max_seq_len=32, **fields)


def test_block_causal_equals_each_document_alone():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DeepSeekV3Transformer(_tiny())
    model.to_empty(device="cpu")
    model.init_weights(torch.device("cpu"))
    eos = 3
    tokens = torch.randint(4, 64, (2, 24))
    tokens[0, [6, 15]], tokens[1, 10] = eos, eos  # row 0: documents of 7, 9, 8; row 1: 11, 13
    doc_ids = document_ids(tokens, eos)
    with torch.no_grad():
        got = model(tokens, document_positions(doc_ids), doc_ids=doc_ids)
        for row in range(2):
            for doc in doc_ids[row].unique():
                cols = (doc_ids[row] == doc).nonzero().flatten()
                alone = model(tokens[row : row + 1, cols])  # positions 0.. inside the document
                torch.testing.assert_close(got[row : row + 1, cols], alone, rtol=1e-5, atol=1e-5)
        assert (got - model(tokens)).abs().max() > 1e-3  # the masking matters


EXACT = {"671B": 671_026_404_352, "kimi_k2": 1_026_408_209_408, "16B": 15_706_484_224}


@pytest.mark.parametrize("flavor", list(DSV3_PUBLISHED))
def test_flavor_sizes_equal_transformers_models_of_the_published_config(flavor):
    mla = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DSV3_PUBLISHED[flavor], **mla))
        ours = DeepSeekV3Transformer(deepseek_v3_configs[flavor])
    total = sum(p.numel() for p in ours.parameters())
    print(f"\n{flavor}: ours {total:,}, transformers {sum(p.numel() for p in hf.parameters()):,}")
    assert total == sum(p.numel() for p in hf.parameters()) == EXACT[flavor]


# the rest of each published config.json, as written there (transformers 4 spellings: rope_scaling, "type")
PUBLISHED_REST = {
    "671B": {
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1,
    },
    "kimi_k2": {
        "max_position_embeddings": 131072,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
    },
}


@pytest.mark.parametrize("flavor", list(PUBLISHED_REST))
def test_published_config_json_is_the_flavor(flavor):
    """What a fine-tune from the published checkpoint compares before reading a weight (check_hf_matches)."""
    mla = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    config = {
        **DSV3_PUBLISHED[flavor],
        **mla,
        **PUBLISHED_REST[flavor],
        "num_key_value_heads": DSV3_PUBLISHED[flavor]["num_attention_heads"],
    }
    config |= {"hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False}
    theirs = DeepSeekV3Args.from_dict(ADAPTER.model_args_from_hf(config))
    published = PUBLISHED_REST[flavor][
        "num_nextn_predict_layers"
    ]  # the multi-token-prediction layers (model.mtp_layers)
    want = dataclasses.replace(deepseek_v3_configs[flavor], max_seq_len=theirs.max_seq_len, mtp_layers=published)
    assert theirs == want


def _config(*args: str) -> JobConfig:
    return JobConfig.parse_args(["--job.config_file", os.path.join(ROOT, "train_configs/debug_model.toml"), *args])


def test_preflight_accepts_debugmodel_and_cp_and_names_what_mla_cannot_do_yet():
    dsv3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"]
    assert run_preflight(_config(*dsv3), 1, this_machine=False) == []
    tp2 = ["--training.tensor_parallel_degree", "2", "--experimental.expert_parallel_degree", "2"]
    assert run_preflight(_config(*dsv3, *tp2), 2, this_machine=False) == []  # MLA's TP plan (tensor_parallel/plan.py)
    cp = ["--experimental.context_parallel_degree", "2"]
    assert run_preflight(_config(*dsv3, *cp), 2, this_machine=False) == []  # our ring: v heads of their own width
    torch_cp = [*cp, "--experimental.context_parallel_impl", "torch"]
    with pytest.raises(NotImplementedError, match="torch's ring attention needs v heads as wide as q/k heads"):
        run_preflight(_config(*dsv3, *torch_cp), 2, this_machine=False)


def test_flavor_args_round_trip_through_their_checkpoint_dict():
    for args in deepseek_v3_configs.values():
        assert DeepSeekV3Args.from_dict(dataclasses.asdict(args)) == args


def test_hf_refusal_names_the_flavors_that_export():
    spec = get_model_spec("deepseek_v3")
    assert hf_conversion_refusal(spec, dataclasses.asdict(spec.flavors["671B"])) is None
    why = hf_conversion_refusal(spec, dataclasses.asdict(spec.flavors["16B"]))
    assert "score_func = 'softmax'" in why and "debugmodel, 671B, kimi_k2" in why, why


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"num_expert_groups": 3}, ["MoEArgs.num_expert_groups = 3", "divisor of num_experts = 4"]),
        ({"num_expert_groups": 4}, ["MoEArgs.num_expert_groups = 4", "2 or more experts"]),
        ({"top_k_groups": 3}, ["MoEArgs.top_k_groups = 3", "top_k_groups <= num_expert_groups = 2"]),
        ({"top_k": 3}, ["MoEArgs.top_k_groups = 1", "top_k = 3 <= top_k_groups * 2 experts per group"]),
        ({"qk_rope_head_dim": 7}, ["DeepSeekV3Args.qk_rope_head_dim = 7", "even"]),
        ({"n_kv_heads": 2}, ["DeepSeekV3Args.n_kv_heads = 2", "leave n_kv_heads unset"]),
    ],
)
def test_bad_args_name_the_field_and_the_fix(fields, words):
    with pytest.raises(ValueError) as err:
        _tiny(**fields)  # 4 experts in 2 groups, top 2 from the best group
    assert all(w in str(err.value) for w in words), str(err.value)
