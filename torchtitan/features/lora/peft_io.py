"""PEFT-format adapter folders out and in, and merging adapters into base weights (files: checkpointing/).

A PEFT LoRA folder is ``adapter_config.json`` + ``adapter_model.safetensors`` whose keys are
``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight`` (what ``PeftModel.save_pretrained`` writes).
Names and layouts go through the family's Hugging Face adapter: B is an output-side matrix, so for q/k it
gets the same within-head RoPE row permutation as the base weight (models/common/hf_adapter.py); A is
input-side and unchanged.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from torchtitan.checkpointing.files.marker import does_not_exist
from torchtitan.checkpointing.hf.files import read_safetensors
from torchtitan.config.parse_errors import parsing
from torchtitan.features.lora.names import resolve_targets
from torchtitan.spec import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_OURS_TO_PEFT = {"lora_a": "lora_A", "lora_b": "lora_B"}


def _modules(adapters: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``layers.0.attention.wq`` -> {"lora_a": A, "lora_b": B}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, w in adapters.items():
        module, which, _ = key.rsplit(".", 2)
        out.setdefault(module, {})[which] = w
    return out


def to_peft_state_dict(adapters: dict[str, torch.Tensor], spec: ModelSpec, args: dict[str, Any]) -> dict[str, Any]:
    """Our adapter weights (``layers.0.attention.wq.lora_a.weight``) -> PEFT's keys and layouts."""
    out = {}
    for module, ab in _modules(adapters).items():
        ((hf_key, b),) = spec.state_dict_adapter.to_hf_state_dict({f"{module}.weight": ab["lora_b"]}, args).items()
        hf_module = _PREFIX + hf_key.removesuffix(".weight")
        out[f"{hf_module}.lora_A.weight"] = ab["lora_a"].contiguous()
        out[f"{hf_module}.lora_B.weight"] = b.contiguous()
    return out


def from_peft_state_dict(peft: dict[str, torch.Tensor], spec: ModelSpec, args: dict[str, Any]) -> dict[str, Any]:
    """PEFT's keys (with or without an adapter name, ``lora_A.default.weight``) -> ours.

    Raises:
        ValueError: a key that is not a LoRA A/B weight of this family's modules (another architecture).
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, w in peft.items():
        parts = key.removeprefix(_PREFIX).split(".")
        which = next((p for p in parts if p in ("lora_A", "lora_B")), None)
        if which is None or not key.startswith(_PREFIX):
            raise ValueError(f"PEFT weight {key!r} is not a LoRA A/B weight (modules_to_save, DoRA? not supported)")
        pairs.setdefault(".".join(parts[: parts.index(which)]), {})[which] = w
    out = {}
    for hf_module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"PEFT module {hf_module!r} has {sorted(ab)}, not both lora_A and lora_B")
        try:  # B carries the output rows (q/k: RoPE-permuted); A's name is B's
            ((ours, b),) = spec.state_dict_adapter.from_hf_state_dict(
                {f"{hf_module}.weight": ab["lora_B"]}, args
            ).items()
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"PEFT module {hf_module!r} names no linear of a {spec.name} model ({e})") from e
        module = ours.removesuffix(".weight")
        out[f"{module}.lora_a.weight"], out[f"{module}.lora_b.weight"] = ab["lora_A"], b
    return out


def check_peft_exportable(spec: ModelSpec, target_modules: list[str]) -> None:
    """Raises NotImplementedError (one line) for a PEFT export that peft would load onto other weights."""
    if not spec.adapters.peft_ffn_remapped:
        return
    ffn = [t.name for t in resolve_targets(spec, target_modules) if t.name in ("w1", "w2", "w3")]
    if ffn:  # peft would load them onto the routed experts
        raise NotImplementedError(
            f"a PEFT export of {spec.name} adapters on {ffn}: peft maps gate_proj/up_proj/down_proj of this model "
            "type onto its fused routed experts, not the dense and shared FFNs; export merged (scripts/convert_to_hf.py "
            "--merge_lora) or train attention targets only (lora.target_modules = wq,wkv_a,wkv_b,wo or wq_a,wq_b,...)"
        )


def adapter_config(
    lora: dict[str, Any], spec: ModelSpec, base_model: str | None, adapters: dict[str, Any] = ()
) -> dict[str, Any]:
    """``adapter_config.json``: ``lora`` as a marker records it (rank, alpha, dropout, our target names); a family
    read from its blocks (``hf``) names the modules ``adapters`` (our adapter keys) adapt.

    Raises:
        NotImplementedError: a PEFT folder peft would load onto other weights (``check_peft_exportable``).
    """
    check_peft_exportable(spec, lora["target_modules"])
    if spec.adapters.linears is not None:
        targets = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in adapters})
    else:
        targets = sorted(t.peft for t in resolve_targets(spec, lora["target_modules"]))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_folder(adapters: dict[str, torch.Tensor], config: dict[str, Any], out: str, spec, args) -> None:
    os.makedirs(out, exist_ok=True)
    tensors = to_peft_state_dict(adapters, spec, args)
    save_file(tensors, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def read_peft_folder(folder: str, spec: ModelSpec, args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter_config.json, our adapter weights) of a PEFT LoRA folder.

    Raises:
        FileNotFoundError: not a PEFT folder. ValueError: not LoRA, rsLoRA/DoRA, or keys of another architecture.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"PEFT adapter folder {folder!r} {does_not_exist(folder)}")
    paths = [os.path.join(folder, name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder!r} is not a PEFT adapter folder: no {os.path.basename(path)}")
    with open(paths[0], encoding="utf-8") as f, parsing(paths[0], "valid JSON", fix="fix that line"):
        config = json.load(f)
    unsupported = {"peft_type": config.get("peft_type") != "LORA", "use_rslora": config.get("use_rslora")}
    unsupported |= {"use_dora": config.get("use_dora"), "modules_to_save": config.get("modules_to_save")}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{paths[0]}: {', '.join(f'{k} = {config.get(k)!r}' for k in bad)}: only plain LoRA loads")
    return config, from_peft_state_dict(read_safetensors(paths[1]), spec, args)


def scaling_of(config: dict[str, Any]) -> float:
    return config["lora_alpha"] / config["r"]


@torch.no_grad()
def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scaling: float) -> dict:
    """Base weights with every adapter folded in: ``W + scaling * B @ A`` (in W's dtype), adapters dropped."""
    merged = {k: v for k, v in weights.items() if ".lora_" not in k}
    for module, ab in _modules(adapters).items():
        w = merged[f"{module}.weight"]
        delta = scaling * (ab["lora_b"].double() @ ab["lora_a"].double())
        merged[f"{module}.weight"] = (w.double() + delta).to(w.dtype)
    return merged


def check_adapters_fit_base(adapters: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], folder: str) -> None:
    """Each adapter's A is (r, in) and B (out, r) of a base weight (out, in) of ``weights``.

    Raises:
        ValueError: one line naming the folder and the first mismatch.
    """
    for module, ab in _modules(adapters).items():
        w = weights.get(f"{module}.weight")
        want = None if w is None else ((ab["lora_a"].shape[0], w.shape[1]), (w.shape[0], ab["lora_b"].shape[1]))
        if want is None or (tuple(ab["lora_a"].shape), tuple(ab["lora_b"].shape)) != want:
            got = f"A {tuple(ab['lora_a'].shape)}, B {tuple(ab['lora_b'].shape)}"
            base = "no such weight" if w is None else f"weight {tuple(w.shape)}"
            raise ValueError(
                f"PEFT adapter {folder!r} was trained for another base model ({module}: {got} vs {base}); "
                "use the adapter with the model it was trained on"
            )


def check_peft_fits(
    config: dict[str, Any], adapters: dict[str, torch.Tensor], model: dict[str, Any], folder: str, lora: Any = None
) -> None:
    """A PEFT folder's adapters fit this model (``model``: our FQN -> a tensor or shape holder with ``.shape``)
    and, with ``lora`` (the ``[lora]`` section), this config's rank, alpha and targets.

    Raises:
        ValueError: one line naming the folder, what differs and the fix.
    """
    if lora is not None:
        theirs = {"r": config["r"], "lora_alpha": config["lora_alpha"]}
        ours = {"r": lora.rank, "lora_alpha": lora.alpha}
        if theirs != ours:
            raise ValueError(
                f"lora.adapter_path = {folder!r} has r = {theirs['r']}, lora_alpha = {theirs['lora_alpha']}; the "
                f"config has lora.rank = {lora.rank}, lora.alpha = {lora.alpha}; set them to the adapter's"
            )
    missing = sorted(k for k in adapters if k not in model)
    shapes = [
        f"{k}: adapter {tuple(v.shape)} vs model {tuple(model[k].shape)}"
        for k, v in adapters.items()
        if k in model and tuple(v.shape) != tuple(model[k].shape)
    ]
    if missing or shapes:
        what = f"modules this model lacks, e.g. {missing[:2]}" if missing else f"other shapes, e.g. {shapes[:2]}"
        raise ValueError(
            f"PEFT adapter {folder!r} was trained for another base model ({what}); use the adapter of this model "
            f"(model.name / model.flavor) or the model it was trained on"
        )
    if lora is not None:
        wanted = {k for k in model if ".lora_" in k}
        if set(adapters) != wanted:
            raise ValueError(
                f"lora.adapter_path = {folder!r} adapts {sorted(set(config['target_modules']))}, lora.target_modules "
                f"= {lora.target_modules}; set lora.target_modules to the adapter's"
            )
