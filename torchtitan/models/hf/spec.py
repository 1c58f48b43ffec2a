"""``model.name = "hf"``: any transformers causal LM as a family (models/hf/model.py), its flavors, checks and
Hugging Face conversion (the weights keep transformers' names under ``hf.``).

Flavors: ``config`` builds what ``model.hf_config`` names (a local HF folder, its config.json, or JSON text); the
others are tiny random shapes of the tested architectures, for tests and ``train_configs/hf_debug.toml``.
"""

from __future__ import annotations

import contextlib
import json
import unittest.mock
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.parse_errors import parsing
from torchtitan.models.hf.model import LOGIT_TRANSFORMS, HFArgs, HFCausalLM, unbuilt_tp_styles
from torchtitan.observability.logging import quiet_torchao_import
from torchtitan.spec import AdapterLayout, Deferred, ModelSpec


def from_hf_config(fields: dict[str, Any], source: str) -> HFArgs:
    """``HFArgs`` of a ``config.json`` dict (model_type included)."""
    config = build_hf_config(fields)
    text = config.get_text_config()
    heads = text.num_attention_heads
    return HFArgs(
        config=json.dumps(fields, sort_keys=True),
        n_layers=text.num_hidden_layers,
        dim=text.hidden_size,
        n_heads=heads,
        n_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab_size=text.vocab_size,
        max_seq_len=getattr(text, "max_position_embeddings", 0) or 0,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        source=source,
    )


def build_hf_config(fields: dict[str, Any]):
    """transformers' config object for ``fields`` (refusing what this path cannot build, in one line)."""
    from transformers import AutoConfig

    fields = dict(fields)
    if fields.get("auto_map"):
        raise NotImplementedError(
            "model.hf_config needs remote code (its config.json has auto_map): model.name = 'hf' builds "
            "transformers' own classes only; use a model transformers ships"
        )
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ValueError("model.hf_config has no model_type; a transformers config.json names its architecture there")
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        raise ValueError(f"model.hf_config: model_type {model_type!r} is not one transformers knows ({e})") from None
    return config


def causal_lm_class(config) -> type[nn.Module]:
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise NotImplementedError(
            f"model.hf_config: model_type {config.model_type!r} is not a causal language model in transformers (no "
            "AutoModelForCausalLM class); model.name = 'hf' trains causal LMs only"
        )
    with quiet_torchao_import():  # the model class's module is where transformers first imports torchao
        return AutoModelForCausalLM._model_mapping[type(config)]


def build_transformers(fields: dict[str, Any], vocab_size: int) -> nn.Module:
    """transformers' causal LM for ``fields`` with ``vocab_size`` rows (SDPA attention, no KV cache)."""
    config = build_hf_config(fields)
    config.vocab_size = vocab_size
    config.get_text_config().vocab_size = vocab_size
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return causal_lm_class(config)(config)


HFCausalLM.build_transformers = staticmethod(build_transformers)

_SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "vocab_size": 2048,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
# The tested architectures at tiny shapes (transformers builds them at random init: no download)
TINY: dict[str, dict[str, Any]] = {
    "llama_tiny": {"model_type": "llama", **_SMALL},
    "mistral_tiny": {"model_type": "mistral", **_SMALL, "sliding_window": None},
    "gemma3_tiny": {
        "model_type": "gemma3_text",
        **_SMALL,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "olmo2_tiny": {"model_type": "olmo2", **_SMALL},
    "smollm3_tiny": {"model_type": "smollm3", **_SMALL, "no_rope_layers": [1, 0]},
    "phi3_tiny": {"model_type": "phi3", **_SMALL, "sliding_window": None},
    "qwen3_moe_tiny": {
        "model_type": "qwen3_moe",
        **_SMALL,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "olmoe_tiny": {
        "model_type": "olmoe",
        **_SMALL,
        "intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
}
CONFIG_FLAVOR = "config"


class _Flavors(Mapping):
    """The flavors' args, built from their transformers config on first use (importing transformers then)."""

    def __init__(self):
        self._built: dict[str, HFArgs] = {}

    def __getitem__(self, name: str) -> HFArgs:
        if name == CONFIG_FLAVOR:
            return HFArgs(source="model.hf_config")
        if name not in self._built:
            self._built[name] = from_hf_config(TINY[name], name)
        return self._built[name]

    def __iter__(self):
        return iter([*TINY, CONFIG_FLAVOR])

    def __len__(self) -> int:
        return len(TINY) + 1


def read_hf_config(source: str) -> dict[str, Any]:
    """``model.hf_config``: a folder holding config.json, the file itself, or JSON text ``{"model_type": ...}``."""
    if source.lstrip().startswith("{"):
        with parsing("model.hf_config", "valid JSON", fix="give a folder, a config.json or a JSON dict"):
            return json.loads(source)
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"model.hf_config = '{source}': no config.json there; give a local HF model folder")
    with parsing(file, "valid JSON", fix="fix that line, or save the folder again with save_pretrained"):
        return json.loads(file.read_text(encoding="utf-8"))


def configure(args: HFArgs, model) -> HFArgs:
    """The flavor's args, or with ``model.flavor = 'config'`` the transformers config ``model.hf_config`` names."""
    if model.flavor != CONFIG_FLAVOR:
        if model.hf_config:
            raise ConfigError(
                f"model.hf_config is set and model.flavor = {model.flavor!r}: the config builds the model only with "
                f"model.flavor = '{CONFIG_FLAVOR}'; set it, or unset model.hf_config"
            )
        return args
    if not model.hf_config:
        raise ConfigError(
            f"model.flavor = '{CONFIG_FLAVOR}' reads model.hf_config, which is unset: give a local HF model folder, "
            'its config.json, or JSON text {"model_type": ...}'
        )
    return from_hf_config(read_hf_config(model.hf_config), model.hf_config)


def config_vocab(args: HFArgs) -> int | None:
    """The ``vocab_size`` the config.json of ``model.hf_config`` sets (the embedding keeps it); None for a tiny flavor
    of ours or a config that sets none (the tokenizer's words size the embedding)."""
    if args.source in TINY:
        return None
    fields = args.config_dict
    return fields.get("vocab_size") or (fields.get("text_config") or {}).get("vocab_size")


def check_hf(args: HFArgs, *, model, training, experimental) -> list[str]:
    """What the generic path does not build, refused in one line each."""
    config = build_hf_config(args.config_dict)
    causal_lm_class(config)
    for key, degree, why in (
        ("experimental.pipeline_parallel_degree", experimental.pipeline_parallel_degree, "its stages are not split"),
        ("experimental.context_parallel_degree", experimental.context_parallel_degree, "its attention is not ours"),
    ):
        if degree > 1:
            raise NotImplementedError(
                f"model.name = 'hf' with {key} = {degree}: not built ({why}); use FSDP, HSDP, DDP or TP, or a native "
                "family (docs/models.md)"
            )
    if model.attn_mask_type == "block_causal":
        _check_documents(config, model)
    if model.attention_backend not in ("auto", "sdpa"):
        raise NotImplementedError(
            f"model.attention_backend = {model.attention_backend!r} with model.name = 'hf': transformers' own "
            "attention runs SDPA here; set model.attention_backend = 'auto'"
        )
    if training.tensor_parallel_degree > 1:
        _check_tp(config)
    text = config.get_text_config()
    transforms = [k for k in LOGIT_TRANSFORMS if getattr(text, k, None) not in (None, 1, 1.0)]
    if training.loss_chunk_size > 0 and transforms:
        raise NotImplementedError(
            f"training.loss_chunk_size = {training.loss_chunk_size} with a {config.model_type} model whose logits are "
            f"transformed after the head ({', '.join(transforms)}): the chunked loss applies the head alone; set "
            "training.loss_chunk_size = 0"
        )
    return []


# layer kinds whose documents transformers' packed-sequence mask keeps apart (attention of some extent)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def _check_documents(config, model) -> None:
    """block_causal only with per-document positions (transformers finds the documents where the positions restart:
    its packed-sequence mask), on models whose every layer is attention: a recurrent or convolutional layer (Mamba,
    Gated DeltaNet, short convolutions) would carry its state across the packed documents, which no mask stops."""
    if not model.positions_per_document:
        raise NotImplementedError(
            "model.attn_mask_type = 'block_causal' with model.name = 'hf' needs model.positions_per_document = true: "
            "transformers finds the documents where the positions restart (its packed-sequence mask); set it"
        )
    text = config.get_text_config()
    other = sorted(set(getattr(text, "layer_types", None) or []) - set(ATTENTION_LAYER_TYPES))
    fields = sorted(k for k in vars(text) if k.startswith(("mamba_", "ssm_", "linear_conv", "conv_")))
    if other or fields:
        raise NotImplementedError(
            f"model.attn_mask_type = 'block_causal' with a {config.model_type} model: its "
            f"{'layer types ' + str(other) if other else 'fields ' + str(fields[:3])} are not attention, and their "
            "state would cross the packed documents (transformers masks attention only); use attn_mask_type = "
            "'causal', or a family of ours that restarts them per document (qwen3_5)"
        )


def _check_tp(config) -> None:
    plan = dict(getattr(config.get_text_config(), "base_model_tp_plan", None) or {})
    if not plan:
        raise NotImplementedError(
            f"training.tensor_parallel_degree > 1 with a {config.model_type} model: transformers gives it no TP plan "
            "(base_model_tp_plan); use FSDP or DDP"
        )
    unbuilt = unbuilt_tp_styles(plan)
    if unbuilt:
        listed = ", ".join(f"{k}: {v}" for k, v in sorted(unbuilt.items()))
        raise NotImplementedError(
            f"training.tensor_parallel_degree > 1 with a {config.model_type} model: its TP plan has styles not built "
            f"here ({listed}); use FSDP or DDP"
        )


def count_flop_params(args: HFArgs, model: nn.Module) -> int:
    """Parameters a token is multiplied by: all but the input embedding (kept when tied to the head); an MoE's routed
    experts count ``num_experts_per_tok / num_experts`` of theirs."""
    text = model.hf.config.get_text_config()
    experts, active = getattr(text, "num_experts", None), getattr(text, "num_experts_per_tok", None)
    embed = model.hf.get_input_embeddings().weight
    total = 0.0
    for name, p in model.named_parameters():
        if p is embed and not args.tie_word_embeddings:
            continue
        share = active / experts if experts and active and ".experts." in name else 1.0
        total += p.numel() * share
    return int(total)


class HFAdapter:
    """transformers' names and layouts: ours are theirs under ``hf.``; config.json is the config the model was
    built from, with the run's vocabulary."""

    block_names: Mapping[str, str] = {}

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in sd.items():
            if not key.startswith("hf."):
                raise ValueError(f"weight {key!r} is not a transformers model's (no 'hf.' prefix)")
            out[key.removeprefix("hf.")] = value
        if args.get("tie_word_embeddings"):
            out.pop("lm_head.weight", None)  # transformers saves a tied head once, as the embedding
        return out

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Ours under ``hf.``; a tied head, which transformers saves once (as its embedding), under its own name too
        (the class's ``_tied_weights_keys``: head -> embedding), so a whole model's state dict is complete."""
        out = {f"hf.{key}": value for key, value in hf.items()}
        if args.get("tie_word_embeddings") and args.get("config"):
            tied = causal_lm_class(build_hf_config(json.loads(args["config"])))._tied_weights_keys
            for head, embedding in (tied if isinstance(tied, dict) else {}).items():
                if f"hf.{embedding}" in out:
                    out.setdefault(f"hf.{head}", out[f"hf.{embedding}"])
        return out

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        fields = json.loads(args["config"])
        config = build_hf_config(fields)
        config.vocab_size = args["vocab_size"]
        out = config.to_dict()
        out["architectures"] = [causal_lm_class(config).__name__]
        out["dtype"] = str(dtype).removeprefix("torch.")
        return out

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """The args of the folder's config: its fields (``config``, what builds the model) and the shapes read from
        them; ``max_seq_len`` is the caller's (the run's seq_len, generation's prompt and answer)."""
        args = from_hf_config(config, "config.json")
        return {k: v for k, v in vars(args).items() if k not in ("source", "max_seq_len")}


HF = HFAdapter()


@contextlib.contextmanager
def fake_tensor_context() -> Iterator[None]:
    """The memory estimator's fake step: transformers reads a fake tensor as a traced one and, not knowing whether
    the positions restart (packed documents), builds an explicit mask for every attention; a real run of causal
    attention (or of one document per row, the estimator's assumption for block_causal) builds none, SDPA's causal
    kernel masking by itself. Here no packed documents are found, as in that run."""
    from transformers import masking_utils

    with unittest.mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


# MoE routers: never adapted (a plain linear in some architectures, e.g. OLMoE's gate)
_ROUTERS = ("gate", "router", "shared_expert_gate")


def adaptable_linears(block: nn.Module) -> list[str]:
    """The paths in a decoder layer (before any adapter) of the linears LoRA may adapt: every plain ``nn.Linear``
    but an MoE router (routed experts are grouped weights, not linears)."""
    return [
        name for name, m in block.named_modules() if type(m) is nn.Linear and name.rsplit(".", 1)[-1] not in _ROUTERS
    ]


SPEC = ModelSpec(
    "hf",
    HFCausalLM,
    _Flavors(),
    parallelize_fn=Deferred("torchtitan.distributed.parallelize:parallelize_hf"),
    pipeline_split_fn=None,
    count_flop_params=count_flop_params,
    state_dict_adapter=HF,
    check_fn=check_hf,
    hf_model_type="*",
    configure=configure,
    config_vocab=config_vocab,
    adapters=AdapterLayout(block_names={}, ffn_paths=(), linears=adaptable_linears),
    documents=True,
    fake_tensor_context=fake_tensor_context,
)
