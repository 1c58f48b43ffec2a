"""LoRA on the MoE families, in process: which linears get adapters (attention, dense FFNs, the shared expert;
never the routed experts or the router), step-0 logits equal the base's, the PEFT folder of a qwen3_moe model
loads in ``peft`` on transformers' Qwen3-MoE, and the one-line refusals. Runs: tests/runs/features/test_lora_moe_runs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.features.lora.linear import LoRALinear, is_adapter_key
from torchtitan.preflight import run_preflight

TOKENS = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def _model(*extra: str):
    from tests.support.lora import tiny_model as build

    return build(*extra)


def _adapted(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def test_llama3_moe_adapts_attention_the_dense_ffn_and_the_shared_expert():
    model = _model("--model.name", "llama3_moe", "--lora.enable", "--lora.rank", "4")
    attention = {f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo")}
    dense = {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}  # first_k_dense = 1
    shared = {f"layers.{i}.feed_forward.shared_expert.{w}" for i in range(1, 4) for w in ("w1", "w2", "w3")}
    assert _adapted(model) == attention | dense | shared


def test_qwen3_moe_adapts_attention_only():
    model = _model("--model.name", "qwen3_moe", "--lora.enable", "--lora.rank", "4")  # every layer MoE, no shared
    assert _adapted(model) == {f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo")}


def test_deepseek_v3_adapts_mla_the_dense_ffn_and_the_shared_expert():
    model = _model("--model.name", "deepseek_v3", "--lora.enable", "--lora.rank", "4")  # tiny: no q bottleneck
    attention = {f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wkv_a", "wkv_b", "wo")}
    dense = {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}
    shared = {f"layers.{i}.feed_forward.shared_expert.{w}" for i in range(1, 4) for w in ("w1", "w2", "w3")}
    assert _adapted(model) == attention | dense | shared
    bottleneck = _model("--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--lora.enable")
    assert {n.rsplit(".", 1)[-1] for n in _adapted(bottleneck) if ".attention." in n} == {
        "wq_a",
        "wq_b",
        "wkv_a",
        "wkv_b",
        "wo",
    }


@pytest.mark.parametrize("family", ["llama3_moe", "qwen3_moe", "deepseek_v3"])
def test_step_zero_logits_equal_the_base_exactly_and_experts_router_are_frozen(family: str):
    base = _model("--model.name", family)
    lora = _model("--model.name", family, "--lora.enable", "--lora.rank", "4")
    assert torch.equal(base(TOKENS), lora(TOKENS))  # B = 0: the update is exactly 0
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    frozen = {n for n, p in lora.named_parameters() if not p.requires_grad}
    assert any(".experts.w1" in n for n in frozen) and any(".router.gate." in n for n in frozen)
    assert {n for n, _ in base.named_parameters()} < {n for n, _ in lora.named_parameters()}  # base keys unchanged


@pytest.mark.parametrize(
    ("family", "targets", "error", "match"),
    [
        ("qwen3_moe", "wq,w1", ConfigError, r"does not adapt .w1.: MoE experts .*valid names .* wq/q_proj"),
        ("qwen3_moe", "gate_proj", ConfigError, r"does not adapt 'gate_proj': MoE experts"),
        ("llama3_moe", "wq,experts", ConfigError, r"does not adapt 'experts': MoE experts \(grouped weights\)"),
        ("llama3_moe", "router", ConfigError, r"does not adapt 'router'.*valid names .* w1/gate_proj"),
        ("deepseek_v3", "wq_a", ConfigError, r"flavor debugmodel_tiny has none of them"),
        ("deepseek_v3", "experts", ConfigError, r"does not adapt 'experts'.*kv_a_proj_with_mqa"),
        ("gpt_oss", "wq", NotImplementedError, r"model.name = 'gpt_oss': not built.*qwen3_moe, deepseek_v3"),
    ],
)
def test_moe_refusals_are_one_line(family: str, targets: str, error: type, match: str):
    from tests.support.lora import tiny_config

    config = tiny_config("--model.name", family, "--lora.enable", "--lora.target_modules", targets)
    with pytest.raises(error, match=match) as e:
        run_preflight(config, 1, this_machine=False)
    assert "\n" not in str(e.value)


def test_qlora_on_an_moe_family_is_one_line_and_exit_2(capsys, monkeypatch):
    from tests.support.lora import TINY
    from tests.support.runs import ROOT, error_lines
    from torchtitan.preflight.__main__ import main

    monkeypatch.chdir(ROOT)
    argv = [*TINY, "--model.name", "qwen3_moe", "--lora.enable", "--lora.quantize_base", "nf4"]
    code = main(["--world_size", "1", *argv])
    out = capsys.readouterr()
    lines = error_lines(out.err + out.out)
    assert code == 2 and len(lines) == 1, out.err
    assert "lora.quantize_base = 'nf4' with model.name = 'qwen3_moe': not built" in lines[0]


def test_planner_counts_the_moe_layers_adapters():
    """estimation.py --plan's adapter count: llama3_moe's dense layer 0 and its MoE layers' shared experts differ."""
    from tests.support.lora import tiny_config
    from torchtitan.features.lora.estimate import adapter_param_count

    model = _model("--model.name", "llama3_moe", "--lora.enable", "--lora.rank", "4")
    real = sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))
    config = tiny_config("--model.name", "llama3_moe", "--lora.enable", "--lora.rank", "4")
    assert adapter_param_count(config, 4) == real


@pytest.mark.parametrize(
    ("family", "flavor", "targets"),
    [("qwen3_moe", "debugmodel_aux_loss", "wq,wk,wv,wo"), ("deepseek_v3", "debugmodel_tiny", "wq,wkv_a,wkv_b,wo")],
)
def test_moe_adapter_loads_in_peft_on_transformers(family: str, flavor: str, targets: str, tmp_path):
    """Our PEFT folder of a qwen3_moe model (the aux-loss flavor: HF's Qwen3-MoE has no expert bias) or deepseek_v3
    model (attention targets: peft re-targets its FFN names at the fused experts, refused below) on transformers'
    model built from our HF export of the base: our logits within 1e-5 (fp32); an adapter ``peft`` wrote for that
    model loads into ours with peft's logits."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from tests.support.lora import PEFT_TOL, save_hf_base
    from torchtitan.features.lora.peft_io import adapter_config, check_peft_fits, read_peft_folder, save_peft_folder
    from torchtitan.spec import get_model_spec

    lora = ["--lora.enable", "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", targets]
    model = _model("--model.name", family, "--model.flavor", flavor, *lora).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(0, 0.05)
        ours = model(TOKENS)
    args, spec = dataclasses.asdict(model.args), get_model_spec(family)
    hf_model = save_hf_base(model, family, args, str(tmp_path / "base"))
    adapters = {k: v.detach() for k, v in model.state_dict().items() if is_adapter_key(k)}
    lora_info = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": targets.split(",")}
    save_peft_folder(adapters, adapter_config(lora_info, spec, None), str(tmp_path / "ours"), spec, args)
    with torch.no_grad():
        base_gap = (hf_model(TOKENS).logits - ours).abs().max().item()
        peft_model = peft.PeftModel.from_pretrained(hf_model, str(tmp_path / "ours")).eval()
        gap = (peft_model(TOKENS).logits - ours).abs().max().item()
    print(f"{family}: peft vs ours {gap:.2e} (base without adapters {base_gap:.2e})")
    assert base_gap > 1e-3 and gap <= PEFT_TOL, (base_gap, gap)
    peft_model = peft_model.unload()  # transformers' base again, for peft's own adapter
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=adapter_config(lora_info, spec, None)["target_modules"])
    config.init_lora_weights = False  # random B, so the adapter is not a no-op
    torch.manual_seed(3)
    theirs = peft.get_peft_model(peft_model, config).eval()
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded_config, loaded = read_peft_folder(str(tmp_path / "theirs"), spec, args)
    check_peft_fits(loaded_config, loaded, model.state_dict(), str(tmp_path / "theirs"))
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    assert not unexpected and all(not is_adapter_key(k) for k in missing)
    with torch.no_grad():
        gap = (model(TOKENS) - theirs(TOKENS).logits).abs().max().item()
    assert gap <= PEFT_TOL, gap


def test_moe_lora_under_pipeline_parallel_is_refused():
    from tests.support.lora import tiny_config

    extra = ["--model.name", "qwen3_moe", "--lora.enable", "--experimental.pipeline_parallel_degree", "2"]
    with pytest.raises(NotImplementedError, match=r"'qwen3_moe' and experimental.pipeline_parallel_degree > 1: not"):
        run_preflight(tiny_config(*extra, world_size=2), 2, this_machine=False)


def test_a_peft_folder_for_llama3_moe_is_refused():
    from tests.support.lora import tiny_config

    extra = ["--model.name", "llama3_moe", "--lora.enable", "--lora.adapter_path", "somewhere"]
    with pytest.raises(NotImplementedError, match=r"lora.adapter_path = 'somewhere': model.name = 'llama3_moe' has no"):
        run_preflight(tiny_config(*extra), 1, this_machine=False)


def test_a_peft_export_of_deepseek_ffn_adapters_is_refused():
    from tests.support.lora import tiny_config

    extra = ["--model.name", "deepseek_v3", "--lora.enable", "--checkpoint.enable_checkpoint"]
    with pytest.raises(NotImplementedError, match=r"peft maps gate_proj/up_proj/down_proj of this model type onto"):
        run_preflight(tiny_config(*extra, "--checkpoint.last_save_in_hf"), 1, this_machine=False)
    run_preflight(
        tiny_config(*extra, "--checkpoint.last_save_in_hf", "--lora.target_modules", "wq,wo"), 1, this_machine=False
    )
