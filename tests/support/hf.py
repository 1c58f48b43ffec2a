"""Hugging Face things the tests build and check locally: random-init models, a small BPE tokenizer, export checks.

Nothing is downloaded: models are transformers' classes of our flavors' shapes, the tokenizer is trained on a few
KB of the shipped corpus.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.support.runs import ROOT
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.config.manager import JobConfig
from torchtitan.spec import get_model_spec


def save_random_hf_model(argv: list[str], folder: str) -> None:
    """A random-init HF model of the shapes the run ``argv`` builds (its flavor, its tokenizer's vocabulary),
    saved by transformers in shards (tests/runs/features/test_sft_recipe.py starts from one too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchtitan.build import build_meta_model, build_model_args
    from torchtitan.estimation.fake_trainer import resolve_vocab
    from torchtitan.spec import get_model_spec

    config = JobConfig.parse_args(argv)
    spec = get_model_spec(config.model.name)
    args = build_model_args(config, spec, resolve_vocab(config)[0])
    meta = build_meta_model(spec, args).state_dict()
    hf_config = spec.state_dict_adapter.hf_config(dataclasses.asdict(args), meta, dtype=torch.float32)
    torch.manual_seed(11)
    model_type = hf_config.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf_config))
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="400KB")


def tiny_qwen3(vocab_size: int, **overrides):
    """A random-init transformers Qwen3ForCausalLM of two tiny layers (hidden 32, 4 heads of 8, 2 key/value heads)
    over ``vocab_size`` rows, seeded: the same weights every call. ``overrides``: other Qwen3Config fields."""
    import transformers

    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(vocab_size=vocab_size, **shape | overrides))


def hf_logits(folder: str, inputs: torch.Tensor) -> torch.Tensor:
    """transformers' logits (bs, seq, vocab) for ``inputs`` of the HF folder, which must load with no
    missing, unexpected or mismatched weight."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model(inputs).logits


EXPORT_TOL = (
    1e-5  # fp32; measured max |Δlogits| 1.2e-6 to 1.4e-6 (the export is exact; the two forwards sum in other orders)
)
SHORT_SEQ = 32
SHORT = [
    *("--training.steps", "3", "--training.seq_len", str(SHORT_SEQ), "--training.batch_size", "2"),
    *("--training.warmup_steps", "1", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"),
    *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "1000", "--validation.enabled", "false"),
]


def our_model(step_folder: str) -> tuple[torch.nn.Module, int]:
    """Our model with the checkpoint's weights (fp32, eval), and its vocabulary."""
    weights, marker = load_model_weights(step_folder)
    spec = get_model_spec(marker["model"]["name"])
    args = type(next(iter(spec.flavors.values()))).from_dict(marker["model"]["args"])
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(weights)
    return model.eval(), args.vocab_size


def check_export_logits(name: str, step: str, out: str) -> None:
    """transformers loads the HF folder ``out`` with no missing or unexpected weight, and its logits equal those
    of our model with the checkpoint ``step``'s weights (fp32, max |Δ| <= EXPORT_TOL)."""
    transformers = pytest.importorskip("transformers")  # skips the calling test where it is not installed
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours, vocab = our_model(step)
    tokens = torch.randint(0, vocab, (2, SHORT_SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        delta = (hf.eval()(tokens).logits - ours(tokens)).abs().max().item()
    print(f"\n{name}: {type(hf).__name__}, max |dlogits| {delta:.1e}")
    assert delta <= EXPORT_TOL, f"{name}: max |dlogits| {delta} > {EXPORT_TOL}"


LLAMA3_MOE = (
    "model.name = 'llama3_moe' has no Hugging Face counterpart: no transformers architecture has its layers "
    "(Llama's attention with routed experts beside an ungated shared expert, the first layer dense; Mixtral has "
    "no shared expert, Qwen2-MoE gates it, DeepSeek-V3 has its own attention); train model.name = 'qwen3_moe' "
    "(flavor debugmodel_aux_loss at the debug size) for a mixture of experts that exports"
)
SHIPPED_CORPUS = Path(ROOT) / "torchtitan/datasets/assets/pydocs/pydocs.jsonl"
# Qwen3's special tokens (its tokenizer_config: no bos_token, eos <|im_end|>, pad <|endoftext|>)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512


def corpus_texts(n: int) -> list[str]:
    with SHIPPED_CORPUS.open(encoding="utf-8") as f:
        return [json.loads(line)["text"][:2000] for _, line in zip(range(n), f)]


def write_tokenizer(folder: Path, config: dict | None) -> Path:
    """A byte-level BPE like Qwen3's, trained on a few KB of the shipped corpus; config -> tokenizer_config.json."""
    import tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(20), trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"
