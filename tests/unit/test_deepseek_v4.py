"""DeepSeek-V4 (models/deepseek_v4), in process: logits equal transformers' ``DeepseekV4ForCausalLM`` on tiny random
models of several shapes (import and export through the converters), greedy generation with our cache equals
transformers' generate, the published Flash size, and bad args / layouts refused in one line.

The HF models are random-init fp32 with every learned bias that transformers starts at zero or one drawn at std 0.5
(sinks, compressor slot biases, hyper-connection bases, the selection bias), experts at std 0.5 with a SwiGLU limit
of 1 so the clamps bite, a random hash table, windows shorter than the sequence and an index_topk smaller than the
compressed entries, so every piece moves the logits.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.convert import export_to_hf, import_from_hf
from torchtitan.components.generation import generate
from torchtitan.config.manager import JobConfig
from torchtitan.models.deepseek_v4 import DeepSeekV4Args, DeepSeekV4Transformer, deepseek_v4_configs
from torchtitan.models.deepseek_v4.hf_adapter import ADAPTER
from torchtitan.spec import get_model_spec

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 23
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
TINY_HF = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "q_lora_rank": 24,
    "num_experts_per_tok": 2,
    "n_routed_experts": 4,
    "sliding_window": 6,  # < SEQ
    "o_groups": 2,
    "o_lora_rank": 8,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 3,  # < the 11 entries of a 23-token CSA layer at rate 2
    "compress_rates": {CSA: 2, HCA: 4},
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "hc_mult": 3,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 64,
    "swiglu_limit": 1.0,
}
SHAPES = {
    "mixed": {},
    # YaRN on the compressed RoPE, one stream, sigmoid scores, rates that divide neither the window nor the sequence
    "yarn_one_stream": {
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "hc_mult": 1,
        "scoring_func": "sigmoid",
        "num_hidden_layers": 3,
        "layer_types": None,  # transformers' default schedule: HCA, HCA, CSA
        "mlp_layer_types": None,  # its default: all three hash-routed
        "compress_rates": {CSA: 3, HCA: 5},
    },
    # 8 heads in 4 groups, a window over the whole sequence, index_topk above the entries
    "wide_window": {"o_groups": 4, "num_attention_heads": 8, "index_topk": 100, "sliding_window": 30},
}


def _hf_model(**overrides):
    config = transformers.DeepseekV4Config(**(TINY_HF | overrides))
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")) or "experts" in name:
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, config.n_routed_experts, b.shape))
    return model


def _ours(hf) -> tuple[DeepSeekV4Transformer, DeepSeekV4Args]:
    args = DeepSeekV4Args.from_dict(ADAPTER.model_args_from_hf(hf.config.to_dict()))
    with torch.device("meta"):
        model = DeepSeekV4Transformer(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(ADAPTER.from_hf_state_dict(dict(hf.state_dict()), dataclasses.asdict(args)))
    return model.eval(), args


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers(shape):
    hf = _hf_model(**SHAPES[shape])
    ours, args = _ours(hf)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    tokens = _tokens()
    with torch.no_grad():
        want, got = hf(tokens).logits, ours(tokens)
    gap = ((got - want).abs().max() / want.abs().max()).item()
    print(f"\ndeepseek_v4 {shape}: max |dlogits| / max |logits| = {gap:.1e}")
    assert gap <= 1e-5, gap
    if shape == "mixed":  # the indexer's choice and the sinks each move the logits far more than the gap
        for other in (dataclasses.replace(args, index_topk=100), dataclasses.replace(args, sliding_window=30)):
            moved = DeepSeekV4Transformer(other)
            moved.load_state_dict(ours.state_dict())
            with torch.no_grad():
                assert (moved.eval()(tokens) - want).abs().max() > 1e3 * gap * want.abs().max()


def test_import_and_export_round_trip_through_transformers_folders(tmp_path):
    hf = _hf_model()
    folder, seed, out = str(tmp_path / "hf_in"), str(tmp_path / "seed" / "step-0"), str(tmp_path / "hf_out")
    hf.save_pretrained(folder, safe_serialization=True)
    import_from_hf(folder, seed)  # the family from config.json's model_type
    weights, _ = load_model_weights(seed)
    with open(os.path.join(folder, "config.json")) as f:
        args = DeepSeekV4Args.from_dict(ADAPTER.model_args_from_hf(json.load(f)))
    ours = DeepSeekV4Transformer(args)
    ours.load_state_dict(weights)
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        torch.testing.assert_close(ours.eval()(tokens), want, rtol=1e-5, atol=1e-5)
    export_to_hf(seed, out)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(back).__name__ == "DeepseekV4ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(tokens).logits, want, rtol=1e-5, atol=1e-5)


def test_greedy_generation_with_our_cache_equals_transformers_generate():
    """12 new tokens after a 13-token prompt: past every window, CSA and HCA entries finishing during decoding. The
    matrices are drawn at unit gain so attention, not the embedding alone, picks the tokens."""
    hf = _hf_model(max_position_embeddings=128)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not any(s in name for s in ("embed", "hc", "experts")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * p.shape[-1] ** -0.5)
    ours, _ = _ours(hf)
    prompt = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one token's tiny ops: threads only add their hand-offs (20x slower on a busy CPU)
    try:
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
        got = generate(ours, prompt, 12, use_cache=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want), (got[:, 13:].tolist(), want[:, 13:].tolist())
    assert torch.equal(got, generate(ours, prompt, 12, use_cache=False))
    assert len(set(got[:, 13:].flatten().tolist())) > 5  # not one token repeated


def test_flash_has_transformers_parameter_count():
    args = deepseek_v4_configs["flash"]
    config = ADAPTER.hf_config(dataclasses.asdict(args), {}, torch.bfloat16)
    config = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        ours = DeepSeekV4Transformer(args)
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config))
    count = sum(p.numel() for p in ours.parameters())
    print(f"\ndeepseek_v4 flash: {count:,} parameters (transformers {sum(p.numel() for p in hf.parameters()):,})")
    assert (
        count == sum(p.numel() for p in hf.parameters()) == 284_332_230_231
    )  # DeepSeek-V4-Flash: 284B (its MTP layer not built)
    assert DeepSeekV4Args.from_dict(ADAPTER.model_args_from_hf(config)) == args  # config.json -> the same flavor


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"layer_types": (SLIDING, "global_attention", HCA, CSA)}, r"layer_types\[1\] = 'global_attention' is unknown"),
        ({"mlp_layer_types": ("moe",) * 3}, "mlp_layer_types has 3 entries for n_layers = 4"),
        ({"o_groups": 3}, "o_groups = 3 is invalid: use a divisor of n_heads \\* head_dim = 128"),
        ({"csa_rate": 0}, "csa_rate = 0 is invalid"),
        ({"rope_dim": 48}, "rope_dim = 48 is invalid"),
    ],
)
def test_bad_args_end_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as info:
        dataclasses.replace(deepseek_v4_configs["debugmodel"], **fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["--training.tensor_parallel_degree", "2"], "no TP plan of ours shards yet"),
        (["--experimental.context_parallel_degree", "2"], "a sequence shard cannot see"),
        (["--model.attn_mask_type", "block_causal"], "pool across document boundaries"),
    ],
)
def test_layouts_that_cannot_be_built_are_refused_in_one_line(monkeypatch, overrides, match):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = get_model_spec("deepseek_v4")

    def check(*extra: str) -> list[str]:
        config = JobConfig.parse_args(["--job.config_file", "train_configs/deepseek_v4_debug.toml", *extra])
        sections = dict(model=config.model, training=config.training, experimental=config.experimental)
        return spec.check_fn(spec.flavors["debugmodel"], **sections)

    assert check() == []
    with pytest.raises(NotImplementedError, match=match) as info:
        check(*overrides)
    assert "\n" not in str(info.value)


def test_pipeline_parallel_needs_every_hash_layer_on_the_first_stage(monkeypatch):
    """PP2 of the debug config (hash layer 0; stages 0-1, 2-3) is accepted; a hash layer on a later stage, placed
    there by the flavor or by the split points, is refused in one line naming the layer, the stage and the fix."""
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = get_model_spec("deepseek_v4")
    pp2 = ["--experimental.pipeline_parallel_degree", "2", "--training.data_parallel_shard_degree", "1"]

    def check(args: DeepSeekV4Args, *extra: str) -> list[str]:
        config = JobConfig.parse_args(["--job.config_file", "train_configs/deepseek_v4_debug.toml", *pp2, *extra])
        return spec.check_fn(args, model=config.model, training=config.training, experimental=config.experimental)

    debug = spec.flavors["debugmodel"]
    assert check(debug) == []
    assert check(debug, "--experimental.pipeline_parallel_split_points", "layers.1") == []
    last_hashed = dataclasses.replace(debug, mlp_layer_types=("moe", "moe", "moe", "hash_moe"))
    two_hashed = dataclasses.replace(debug, mlp_layer_types=("hash_moe", "hash_moe", "moe", "moe"))
    for args, extra, match in (
        (last_hashed, [], r"hash_moe layer 3 falls on pipeline stage 1 \(layers 2\.\.3\).*last layer is hash-routed"),
        (
            two_hashed,
            ["--experimental.pipeline_parallel_split_points", "layers.1"],
            "hash_moe layer 1 falls on "
            r"pipeline stage 1 \(layers 1\.\.3\).*split_points starting at layers\.2 or later, or fewer stages",
        ),
    ):
        with pytest.raises(NotImplementedError, match=match) as info:
            check(args, *extra)
        assert "\n" not in str(info.value)


def test_pipeline_stages_pass_the_streams_and_compute_the_whole_models_logits():
    """Two stages pruned from fresh builds (``output_modules``: hc_head, norm and output only on the last) pass the
    (bs, n, hc, dim) streams and give the whole model's logits exactly (fp32, same seed)."""
    from torchtitan.distributed.init import init_model_weights
    from torchtitan.distributed.pipeline.stages import prune_to_stage

    args = dataclasses.replace(deepseek_v4_configs["debugmodel_tiny"], vocab_size=VOCAB, max_seq_len=64)
    parts = []
    for bounds in ((0, 4, True, True), (0, 2, True, False), (2, 4, False, True)):
        with torch.device("meta"):
            part = DeepSeekV4Transformer(args)
        prune_to_stage(part, *bounds)
        part.to_empty(device="cpu")
        init_model_weights(part, 0, torch.device("cpu"))
        parts.append(part)
    whole, first, last = parts
    assert first.hc_head is None and first.norm is None and last.tok_embeddings is None and last.hc_head is not None
    tokens = _tokens()[:1]  # (1, SEQ)
    streams = first(tokens)
    assert streams.shape == (1, SEQ, args.hc_mult, args.dim)
    assert torch.equal(last(streams), whole(tokens))


def test_an_index_topk_the_sequence_cannot_make_sparse_is_refused_in_one_line(monkeypatch):
    from torchtitan.config.errors import ConfigError

    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    spec = get_model_spec("deepseek_v4")
    config = JobConfig.parse_args(["--job.config_file", "train_configs/deepseek_v4_debug.toml"])
    sections = dict(model=config.model, training=config.training, experimental=config.experimental)
    flavor = spec.flavors["debugmodel"]  # top 8 of seq_len // csa_rate compressed entries
    config.training.seq_len = 36  # 9 entries: the top 8 still choose
    assert spec.check_fn(flavor, **sections) == []
    config.training.seq_len = 32  # 8 entries: all kept
    with pytest.raises(ConfigError, match="index_topk = 8 >= training.seq_len // csa_rate = 32 // 4 = 8") as info:
        spec.check_fn(flavor, **sections)
    assert "\n" not in str(info.value)
    sliding_only = dataclasses.replace(flavor, layer_types=("sliding_attention",) * 4)  # no layer ranks entries
    assert spec.check_fn(sliding_only, **sections) == []


def test_layer_pattern_is_the_repeating_tail():
    spec = get_model_spec("deepseek_v4")
    assert spec.layer_pattern(deepseek_v4_configs["flash"]) == (3, 2)  # hash layers 0-2, then CSA/HCA alternate
    assert spec.layer_pattern(deepseek_v4_configs["debugmodel"]) == (0, 4)  # no kind repeats twice: one period
