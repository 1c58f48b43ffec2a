"""A Hugging Face model folder's files (config.json, the safetensors index, writing weights): light, so the
pre-launch checks use it without the conversion machinery (hf.py)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from torchtitan.checkpointing.files.marker import does_not_exist
from torchtitan.config.parse_errors import parsing
from torchtitan.models.common.mtp import held_mtp_layers

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.spec import ModelSpec


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """An HF model folder's ``config.json``.

    Raises:
        ValueError: no such folder, or no ``config.json`` in it.
    """
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        what = "has no config.json" if os.path.isdir(hf_dir) else does_not_exist(hf_dir)
        raise ValueError(
            f"Hugging Face folder {hf_dir!r} {what}; pass a folder written by save_pretrained "
            f"(config.json + *.safetensors)"
        )
    with open(path, encoding="utf-8") as f, parsing(path, "valid JSON", fix=_FIX_JSON):
        return json.load(f)


# a folder's JSON files are written by save_pretrained; a hand edit that breaks one is fixed at the line named
_FIX_JSON = "fix that line, or save the folder again with save_pretrained"
# a safetensors file's first 8 bytes give its JSON header's length: a file that is not one (or cut short) fails there
_FIX_SAFETENSORS = "the file is not safetensors or was cut short; copy or save it again"


def hf_weight_files(hf_dir: str) -> dict[str, str]:
    """Every weight of an HF folder -> the safetensors file holding it (index file or all ``*.safetensors``).

    Raises:
        ValueError: no safetensors files (a PyTorch ``.bin`` checkpoint is not read: re-save it with
            ``save_pretrained(..., safe_serialization=True)``).
    """
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f, parsing(index, "valid JSON", fix=_FIX_JSON):
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
    names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(
            f"Hugging Face folder {hf_dir!r} has no *.safetensors files; re-save the model with "
            f"save_pretrained(..., safe_serialization=True)"
        )
    files = {}
    for name in names:
        path = os.path.join(hf_dir, name)
        with open_safetensors(path) as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def open_safetensors(path: str) -> Any:
    """``safe_open(path)`` (a context manager: its tensors read lazily), a header that does not parse named in one
    line."""
    with parsing(path, "a safetensors file", part="header", fix=_FIX_SAFETENSORS, errors=(SafetensorError,)):
        return safe_open(path, framework="pt")


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (``safetensors.torch.load_file``), a header that does not parse named in one
    line."""
    with parsing(path, "a safetensors file", part="header", fix=_FIX_SAFETENSORS, errors=(SafetensorError,)):
        return load_file(path)


# transformers' default shard size for save_pretrained
MAX_SHARD_BYTES = 5 * 10**9


def save_hf_folder(
    hf: dict[str, torch.Tensor], config: dict[str, Any], output_dir: str, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """``config.json`` and the weights: ``model.safetensors``, or shards over ``max_shard_bytes``
    (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, as transformers writes)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, w in hf.items():
        nbytes = w.numel() * w.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = w
        size += nbytes
    os.makedirs(output_dir, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(output_dir, name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(w.numel() * w.element_size() for w in hf.values())
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config_path = os.path.join(output_dir, "config.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    # safetensors writes through a private temporary file (mode 0600); give the weights the mode every
    # other file here gets (0666 less the umask: config.json's), as save_pretrained's do.
    mode = os.stat(config_path).st_mode & 0o777
    for name in os.listdir(output_dir):
        if name.endswith(".safetensors"):
            os.chmod(os.path.join(output_dir, name), mode)


def vocab_rows(config: JobConfig, spec: ModelSpec, words: int) -> int:
    """The model's embedding rows, one rule for every family (the trainer, the estimator, evaluation and the
    pre-launch check call it): the ``vocab_size`` of the model config the run names, the Hugging Face folder it starts
    from (``checkpoint.initial_load_in_hf``) or the family's own (``ModelSpec.config_vocab``: the ``hf`` family's
    ``model.hf_config``); else the tokenizer's ``words`` (a flavor names no vocabulary). A named vocabulary may be
    padded past the tokenizer's words (Qwen3: 151,936 rows for 151,669 tokens; the padding rows are never looked
    up), never smaller: the model is not resized to the tokenizer.

    Raises:
        ValueError: a named vocabulary smaller than the tokenizer's words (both sizes and the fix), or rows that
            ``training.tensor_parallel_degree`` does not divide.
    """
    ck, model = config.checkpoint, config.model
    if ck.initial_load_in_hf and ck.initial_load_path:
        rows = hf_embedding_rows(ck.initial_load_path, words, model.tokenizer_path)
    else:
        named = spec.config_vocab(spec.flavor_args(model)) if spec.config_vocab is not None else None
        rows = named or words
        if rows < words:
            raise ValueError(
                f"model.hf_config = '{model.hf_config}' sets vocab_size {rows}, fewer rows than the tokenizer's "
                f"{words} words ({model.tokenizer_path}); the model is not resized to its tokenizer: pass the "
                f"tokenizer of that model (model.tokenizer_path), or set vocab_size >= {words} in its config"
            )
    tp = config.training.tensor_parallel_degree
    if rows % tp:
        raise ValueError(
            f"the model's vocabulary ({rows} rows, tokenizer {model.tokenizer_path}) is not divisible by "
            f"training.tensor_parallel_degree = {tp}: TP shards the embedding and output over the vocabulary; "
            "choose a TP degree that divides it"
        )
    return rows


def hf_embedding_rows(hf_dir: str, tokenizer_words: int, tokenizer_path: str) -> int:
    """The embedding rows of an HF model: published models pad their table past the tokenizer's words (Qwen3:
    151,936 rows for 151,669 tokens); the padding rows are never looked up. The trainer, generation and
    evaluation build the model with these rows.

    Raises:
        ValueError: fewer rows than the tokenizer has words (another model's tokenizer).
    """
    config = read_hf_config(hf_dir)
    rows = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size", tokenizer_words)
    if rows < tokenizer_words:
        raise ValueError(
            f"Hugging Face folder {hf_dir!r} has vocab_size {rows}, fewer rows than the tokenizer's "
            f"{tokenizer_words} words ({tokenizer_path}); the model is not resized to its tokenizer: pass the "
            "tokenizer that model was trained with (model.tokenizer_path; its folder's own, when it holds one)"
        )
    return rows


def hf_folder_tokenizer(hf_dir: str) -> str | None:
    """The folder itself when it holds its tokenizer (``tokenizer.json``), as transformers' AutoTokenizer reads
    a model folder; None when it has none."""
    return hf_dir if os.path.isfile(os.path.join(hf_dir, "tokenizer.json")) else None


def hf_folder_args(hf_dir: str, adapter: Any) -> dict[str, Any]:
    """Our model args (a dict) of an HF folder: its config.json's, through the family's ``StateDictAdapter``, with
    the multi-token-prediction layers it holds weights of (``mtp_layers``: DeepSeek-V3's)."""
    fields = adapter.model_args_from_hf(read_hf_config(hf_dir))
    if fields.get("mtp_layers"):
        fields["mtp_layers"] = held_mtp_layers(fields["mtp_layers"], fields["n_layers"], hf_weight_files(hf_dir))
    return fields


def load_hf_weights(hf_dir: str, adapter: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(our model args as a dict, our weights) of an HF folder, through the family's ``StateDictAdapter``."""
    fields = hf_folder_args(hf_dir, adapter)
    hf: dict[str, torch.Tensor] = {}
    for path in sorted(set(hf_weight_files(hf_dir).values())):  # one file, or save_pretrained's shards
        hf.update(read_safetensors(path))
    return fields, adapter.from_hf_state_dict(hf, fields)
