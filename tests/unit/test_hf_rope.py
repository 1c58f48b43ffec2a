"""One HF RoPE reading for every family (models/common/hf_rope.py): the same config dicts give the same RoPE
in every family that implements the type, a one-line ValueError where it does not, and the reading equals
transformers' own standardization (its config class's ``rope_parameters``) for each dict."""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan.models.common.hf_rope import hf_rope_parameters, parse_hf_rope
from torchtitan.models.common.rope.yarn import YarnScaling
from torchtitan.spec import get_model_spec

transformers = pytest.importorskip("transformers")

MAX_LEN = 8192
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CASES = {
    "none": {},
    "theta only": {"rope_theta": 500000.0},
    "rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "legacy llama3 rope_scaling": {
        "rope_theta": 5e5,
        "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 4096},
    },
    "llama3 rope_parameters": {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}},
    "both: rope_scaling wins": {
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "rope_scaling": {**LLAMA3, "factor": 16.0},
    },
    "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}},
    "legacy yarn without original": {"rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 16.0}},
    "yarn factor null": {
        "rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 2048}
    },
    "yarn without factor": {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 2048}},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}
# family -> (its transformers config class, our args' scaling field, the scaled type it implements, its config)
FAMILIES = {
    "llama3": ("LlamaConfig", "rope_scaling", "llama3", {}),
    "qwen3": ("Qwen3Config", "rope_scaling", "llama3", {"intermediate_size": 64}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "rope_scaling",
        "llama3",
        {"intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "rope_scaling",
        "yarn",
        {
            "intermediate_size": 64,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "yarn",
        "yarn",
        {"intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}
BASE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}


def _transformers_rope(family: str, case: dict) -> tuple[float, str, dict | None] | Exception:
    """(theta, type, our scaling) from transformers' standardized ``rope_parameters``, or what it raised."""
    cls = getattr(transformers, FAMILIES[family][0])
    try:
        params = cls(max_position_embeddings=MAX_LEN, **_copy(case)).rope_parameters
    except (KeyError, ValueError) as e:
        return e
    kind, scaling = params["rope_type"], None
    if kind == "llama3":
        scaling = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor")}
        scaling["original_max_seq_len"] = params["original_max_position_embeddings"]
    elif kind == "yarn":
        original = params["original_max_position_embeddings"]
        fields = {f.name for f in dataclasses.fields(YarnScaling)} - {"factor", "original_max_seq_len"}
        factor = params["factor"] if params["factor"] is not None else MAX_LEN / original  # transformers' compute
        extra = {k: params[k] for k in fields if params.get(k) is not None}
        scaling = dataclasses.asdict(YarnScaling(factor=factor, original_max_seq_len=original, **extra))
    return float(params["rope_theta"]), kind, scaling


def _copy(case: dict) -> dict:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in case.items()}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_every_family_reads_a_config_rope_as_transformers_does(case):
    parsed = {}
    for family, (_, field, scaled, extra) in FAMILIES.items():
        config = {**BASE, **extra, "max_position_embeddings": MAX_LEN, **_copy(CASES[case])}
        want = _transformers_rope(family, CASES[case])
        adapter = get_model_spec(family).state_dict_adapter
        if isinstance(want, Exception) or want[1] not in ("default", scaled):
            with pytest.raises(ValueError) as e:
                adapter.model_args_from_hf(config)
            assert "\n" not in str(e.value) and "rope" in str(e.value), str(e.value)
            continue
        args = adapter.model_args_from_hf(config)
        assert (args["rope_theta"], args[field]) == (want[0], want[2]), family
        parsed[family] = args[field]  # theta: each config class has its default (GptOssConfig 150000)
    by_type: dict[str, set] = {}
    for family, result in parsed.items():  # one reading: families implementing a type agree on its scaling
        by_type.setdefault(FAMILIES[family][2], set()).add(repr(result))
    if case not in ("none", "theta only"):  # GptOssConfig alone defaults a RoPE-less config to its YaRN
        assert all(len(results) == 1 for results in by_type.values()), by_type


def test_an_unsupported_rope_names_the_key_the_value_and_what_is_allowed():
    with pytest.raises(
        ValueError, match=r"rope_scaling.rope_type = 'yarn': our Llama implements 'default' and 'llama3'"
    ):
        parse_hf_rope({"rope_scaling": {"type": "yarn", "factor": 2.0}}, family="Llama", supports=("default", "llama3"))
    with pytest.raises(ValueError, match=r"rope_parameters \(rope_type 'yarn'\) has no factor"):
        parse_hf_rope(CASES["yarn without factor"], family="gpt-oss", supports=("default", "yarn"))


@pytest.mark.parametrize("case", ["rope_parameters", "llama3 rope_parameters", "yarn"])
def test_export_writes_rope_parameters_as_save_pretrained_does(tmp_path, case):
    """What we write is transformers 5's config.json form, and reads back to the same RoPE."""
    kind = CASES[case]["rope_parameters"]["rope_type"]
    supports = ("default", kind)
    rope = parse_hf_rope({"max_position_embeddings": MAX_LEN, **_copy(CASES[case])}, family="x", supports=supports)
    written = hf_rope_parameters(rope.theta, rope.rope_type, rope.scaling)
    saved = transformers.LlamaConfig(max_position_embeddings=MAX_LEN, rope_parameters=dict(written))
    saved.save_pretrained(tmp_path)
    on_disk = transformers.LlamaConfig.from_pretrained(tmp_path).to_dict()
    assert "rope_scaling" not in on_disk and "rope_theta" not in on_disk
    assert on_disk["rope_parameters"] == written  # transformers keeps what we wrote, and writes nothing else
    again = parse_hf_rope(
        {"max_position_embeddings": MAX_LEN, "rope_parameters": written}, family="x", supports=supports
    )
    assert again == rope
