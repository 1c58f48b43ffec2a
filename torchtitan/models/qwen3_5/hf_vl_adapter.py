"""Qwen3.5 with images <-> transformers' ``Qwen3_5ForConditionalGeneration`` (``model_type = "qwen3_5"``; the MoE's
``Qwen3_5MoeForConditionalGeneration``, ``"qwen3_5_moe"``): the published multimodal folders, whole.

The language model's weights go through the text adapter (hf_adapter.py) under ``model.language_model.`` (the head
stays ``lm_head``); the tower's names are transformers' own under ``model.visual.`` (ours under ``visual.``). Args
are a dict of ``Qwen35VLArgs``'s fields: the text model's, ``vision`` (a dict) and the special token ids.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.models.common.hf_adapter import HfAdapter
from torchtitan.models.qwen3_5.hf_adapter import QWEN3_5, QWEN3_5_MOE

_TEXT, _VISUAL = "model.language_model.", "model.visual."
_TOKENS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")
# our VisionArgs field -> transformers' vision_config key
_VISION = {
    "depth": "depth",
    "dim": "hidden_size",
    "ffn_dim": "intermediate_size",
    "n_heads": "num_heads",
    "in_channels": "in_channels",
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "spatial_merge_size": "spatial_merge_size",
    "out_dim": "out_hidden_size",
    "num_position_embeddings": "num_position_embeddings",
}


class Qwen35VLAdapter:
    """The whole multimodal checkpoint; ``text``: the language model's adapter (dense or MoE)."""

    def __init__(self, text: HfAdapter, model_type: str, architecture: str):
        self.text, self.model_type, self.architecture = text, model_type, architecture

    @property
    def block_names(self):
        return self.text.block_names

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        text = {k: w for k, w in sd.items() if not k.startswith("visual.")}
        out = {
            (_TEXT + k.removeprefix("model.") if k.startswith("model.") else k): w
            for k, w in self.text.to_hf_state_dict(text, args).items()
        }
        visual = {k.removeprefix("visual."): w for k, w in sd.items() if k.startswith("visual.")}
        return out | {_VISUAL + k: w.contiguous() for k, w in visual.items() if k != "inv_freq"}

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Raises ValueError for a weight of neither part (the MTP layer, ``mtp.*``, is not built and not read)."""
        text = {k: w for k, w in hf.items() if not k.startswith((_VISUAL, "mtp."))}
        out = self.text.from_hf_state_dict(text, args)
        return out | {"visual." + k.removeprefix(_VISUAL): w for k, w in hf.items() if k.startswith(_VISUAL)}

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        text = self.text.hf_config(args, {}, dtype)
        vision = {hf: args["vision"][ours] for ours, hf in _VISION.items()}
        vision |= {"model_type": f"{self.model_type}_vision", "hidden_act": "gelu_pytorch_tanh"}
        vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": args["vision"]["rope_theta"]}
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": vision,
            **{name: args[name] for name in _TOKENS},
            "tie_word_embeddings": text["tie_word_embeddings"],
            "torch_dtype": text["torch_dtype"],
        }

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """``Qwen35VLArgs`` as a dict from the folder's config.json (the text model's refusals apply)."""
        vision_config = config.get("vision_config", {})
        vision = {ours: vision_config[hf] for ours, hf in _VISION.items() if hf in vision_config}
        theta = (vision_config.get("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            vision["rope_theta"] = theta
        tokens = {name: config[name] for name in _TOKENS if name in config}
        return {**self.text.model_args_from_hf(config), "vision": vision, **tokens}


QWEN3_5_VL = Qwen35VLAdapter(QWEN3_5, "qwen3_5", "Qwen3_5ForConditionalGeneration")
QWEN3_5_MOE_VL = Qwen35VLAdapter(QWEN3_5_MOE, "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
