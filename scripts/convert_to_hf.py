"""Convert one of our checkpoints (a complete ``step-N`` folder) to its family's Hugging Face format.

    python scripts/convert_to_hf.py outputs/debug_model/checkpoint/step-30 outputs/hf_debug [--dtype bfloat16]

Writes safetensors and ``config.json`` (``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or
``Qwen3MoeForCausalLM``, from the family its marker names; a ``model.name = "hf"`` run's own transformers class),
which ``transformers.AutoModelForCausalLM.from_pretrained(outputs/hf_debug)`` loads with our logits, and prints one
line (layers, width, dtype). q/k
projection rows are permuted from our interleaved RoPE to HF's rotate-half layout. Weights with no
Hugging Face counterpart (``llama3_moe``; a ``qwen3_moe`` flavor balanced with an expert bias) are
refused with one line saying why and what to train instead (docs/models.md). A LoRA run's checkpoint
becomes a PEFT adapter folder, or with ``--merge_lora`` its base with the adapters merged (docs/lora.md). The
tokenizer is not
converted. The folder is checked against its marker (sizes, CRC32s) and its pickles are read
restricted to plain checkpoint data (docs/checkpoint.md, Integrity).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtitan.checkpointing.files.marker import read_marker  # noqa: E402
from torchtitan.checkpointing.hf.convert import export_to_hf  # noqa: E402
from torchtitan.dtypes import DTYPES  # noqa: E402
from torchtitan.features.lora.hf_export import export_lora  # noqa: E402


def _export(checkpoint: str, output: str, dtype, *, merge_lora: bool) -> dict:
    """A LoRA run's checkpoint (its marker records the adapters) through LoRA's export; any other through
    ``export_to_hf``."""
    if ((read_marker(checkpoint) or {}).get("model") or {}).get("lora"):
        return export_lora(checkpoint, output, merge=merge_lora, dtype=dtype)
    if merge_lora:
        raise ValueError(
            f"--merge_lora: {checkpoint} holds no LoRA adapters (its run had lora.enable off); convert it "
            "without --merge_lora"
        )
    return export_to_hf(checkpoint, output, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a complete step-N checkpoint folder")
    parser.add_argument("output", help="output folder for model.safetensors and config.json")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's dtype")
    parser.add_argument(
        "--merge_lora",
        action="store_true",
        help="a LoRA run's checkpoint: write its base with the adapters merged (a full HF model), not a PEFT folder",
    )
    args = parser.parse_args(argv)
    try:
        config = _export(args.checkpoint, args.output, DTYPES.get(args.dtype), merge_lora=args.merge_lora)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.get("peft_type"):
        print(f"wrote {args.output}: a PEFT LoRA adapter (r {config['r']}, targets {config['target_modules']})")
        return 0
    print(f"wrote {args.output}: {summary(config)}")
    return 0


def summary(config: dict) -> str:
    """Layers, width, vision tower and dtype of a written ``config.json``, each as the folder spells it (transformers 5
    writes ``dtype``, earlier versions and our native families ``torch_dtype``; ``model.name = 'hf'`` writes the
    architecture's own names, e.g. GPT-2's ``n_layer``)."""
    text = config.get("text_config", config)  # a multimodal folder nests the language model's

    def first(*keys: str) -> object:
        return next((d[k] for d in (text, config) for k in keys if d.get(k) is not None), "?")

    tower = f", a vision tower of {config['vision_config']['depth']} blocks" if "vision_config" in config else ""
    layers, hidden = first("num_hidden_layers", "n_layer", "num_layers"), first("hidden_size", "n_embd", "d_model")
    return f"{layers} layers, hidden {hidden}{tower}, {first('dtype', 'torch_dtype')}"


if __name__ == "__main__":
    sys.exit(main())
