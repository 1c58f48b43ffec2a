"""PEFT interop of LoRA adapters, in process: our adapters load into ``peft`` on a transformers model built
from our HF export of the base and give our logits; the merged export too; an adapter ``peft`` itself wrote
loads into our model with peft's logits; folders for another base, rank or architecture are refused."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.support.lora import PEFT_TOL, save_hf_base
from torchtitan.checkpointing.hf.convert import save_hf_folder
from torchtitan.features.lora.linear import is_adapter_key
from torchtitan.features.lora.peft_io import (
    adapter_config,
    check_peft_fits,
    from_peft_state_dict,
    merge_adapters,
    read_peft_folder,
    save_peft_folder,
)
from torchtitan.spec import get_model_spec

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]}


def _ours(family: str, vocab: int = 256) -> tuple[nn.Module, dict]:
    """Our tiny model of ``family`` (``hf:FLAVOR``: that transformers architecture; fp32) with rank-4 adapters on
    every linear LoRA adapts, whose B is random (not the zero init)."""
    from tests.support.lora import tiny_model

    family, _, flavor = family.partition(":")
    extra = ("--model.flavor", flavor) if flavor else ()
    model = tiny_model("--model.name", family, *extra, "--lora.enable", "--lora.rank", "4", "--lora.alpha", "8")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b." in name:
                p.normal_(0, 0.05)
    return model.eval(), dataclasses.asdict(model.args)


# hf: transformers' own classes, the targets read from their layers (Phi-3's fused qkv_proj and gate_up_proj; Qwen3-MoE's
# attention beside grouped experts and a router that are not adapted)
@pytest.mark.parametrize(
    "family", ["llama3", "qwen3", "qwen3_5", "qwen3_5_moe:debugmodel_aux_loss", "hf:phi3_tiny", "hf:qwen3_moe_tiny"]
)
def test_our_adapter_loads_in_peft_and_merges(family: str, tmp_path):
    model, args = _ours(family)
    family = family.partition(":")[0]
    spec = get_model_spec(family)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
    hf_dir, peft_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    hf_model = save_hf_base(model, family, args, hf_dir)
    adapters = {k: v.detach() for k, v in model.state_dict().items() if is_adapter_key(k)}
    config = adapter_config(LORA, spec, hf_dir, adapters)
    save_peft_folder(adapters, config, peft_dir, spec, args)
    saved = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in saved} == set(config["target_modules"])
    with torch.no_grad():
        base_gap = (hf_model(tokens).logits - ours).abs().max().item()
        peft_model = peft.PeftModel.from_pretrained(hf_model, peft_dir).eval()
        gap = (peft_model(tokens).logits - ours).abs().max().item()
    assert base_gap > 1e-3, "the adapters should change the logits"
    assert gap <= PEFT_TOL, f"peft's logits differ from ours by {gap}"
    merged_dir = str(tmp_path / "merged")
    weights = merge_adapters({k: v.detach() for k, v in model.state_dict().items()}, adapters, 8.0 / 4)
    hf = spec.state_dict_adapter.to_hf_state_dict(weights, args)
    save_hf_folder(hf, spec.state_dict_adapter.hf_config(args, weights, dtype=torch.float32), merged_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        merged_gap = (merged(tokens).logits - ours).abs().max().item()
    assert merged_gap <= PEFT_TOL, merged_gap
    print(f"{family}: peft vs ours {gap:.2e}, merged vs ours {merged_gap:.2e}")


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_an_adapter_peft_wrote_loads_into_our_model(family: str, tmp_path):
    model, args = _ours(family)
    spec = get_model_spec(family)
    hf_model = save_hf_base(model, family, args, str(tmp_path / "base"))
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random B too, so the adapter is not a no-op
    )
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(hf_model, config).eval()
    folder = str(tmp_path / "theirs")
    peft_model.save_pretrained(folder)
    loaded_config, adapters = read_peft_folder(folder, spec, args)
    check_peft_fits(loaded_config, adapters, model.state_dict(), folder)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and all(not is_adapter_key(k) for k in missing)
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (model(tokens) - peft_model(tokens).logits).abs().max().item()
    assert gap <= PEFT_TOL, gap


def test_adapters_for_another_base_rank_or_format_are_refused(tmp_path):
    from torchtitan.config.sections.lora import Lora

    llama, args = _ours("llama3")
    spec = get_model_spec("llama3")
    adapters = {k: v.detach() for k, v in llama.state_dict().items() if is_adapter_key(k)}
    folder = str(tmp_path / "a")
    save_peft_folder(adapters, adapter_config(LORA, spec, None), folder, spec, args)
    config, read = read_peft_folder(folder, spec, args)
    with pytest.raises(ValueError, match=r"has r = 4, lora_alpha = 8.0; the config has lora.rank = 8"):
        check_peft_fits(config, read, llama.state_dict(), folder, Lora(enable=True, rank=8, alpha=8.0))
    wider = {k: v.shape for k, v in llama.state_dict().items()}
    wider = {k: torch.empty(s[0] * 2, *s[1:]) if ".lora_b." in k else torch.empty(s) for k, s in wider.items()}
    with pytest.raises(ValueError, match="was trained for another base model .other shapes"):
        check_peft_fits(config, read, wider, folder)
    expert = {f"base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_{x}.weight": torch.zeros(4, 4) for x in "AB"}
    with pytest.raises(ValueError, match="names no linear of a llama3 model"):  # a Qwen3-MoE adapter
        from_peft_state_dict(expert, spec, args)
    with pytest.raises(FileNotFoundError, match="is not a PEFT adapter folder: no adapter_config.json"):
        read_peft_folder(str(tmp_path), spec, args)
    with pytest.raises(FileNotFoundError, match=r"PEFT adapter folder '.*/hf/step-10' does not exist$"):
        read_peft_folder(str(tmp_path / "hf" / "step-10"), spec, args)  # lora.md named a step its run never wrote
    assert os.path.isfile(os.path.join(folder, "adapter_model.safetensors"))


def test_generate_adapter_for_another_base_is_one_line():
    from torchtitan.features.lora.peft_io import check_adapters_fit_base

    adapters = {
        "layers.0.attention.wq.lora_a.weight": torch.zeros(4, 64),
        "layers.0.attention.wq.lora_b.weight": torch.zeros(64, 4),
    }
    check_adapters_fit_base(adapters, {"layers.0.attention.wq.weight": torch.zeros(64, 64)}, "a")
    with pytest.raises(
        ValueError, match=r"'a' was trained for another base model \(layers.0.attention.wq: A \(4, 64\)"
    ):
        check_adapters_fit_base(adapters, {"layers.0.attention.wq.weight": torch.zeros(128, 128)}, "a")
