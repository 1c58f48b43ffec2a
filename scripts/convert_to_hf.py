"""Convert one of our checkpoints (a complete ``step-N`` folder) to its family's Hugging Face format.

    python scripts/convert_to_hf.py outputs/debug_model/checkpoint/step-30 outputs/hf_debug [--dtype bfloat16]

Writes safetensors and ``config.json`` (``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or
``Qwen3MoeForCausalLM``, from the family its marker names), which
``transformers.AutoModelForCausalLM.from_pretrained(outputs/hf_debug)`` loads with our logits. q/k
projection rows are permuted from our interleaved RoPE to HF's rotate-half layout. Weights with no
Hugging Face counterpart (``llama3_moe``; a ``qwen3_moe`` flavor balanced with an expert bias) are
refused with one line saying why and what to train instead (docs/models.md). The tokenizer is not
converted. The folder is checked against its marker (sizes, CRC32s) and its pickles are read
restricted to plain checkpoint data (docs/checkpoint.md, Integrity).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtitan.checkpointing.hf import export_to_hf  # noqa: E402
from torchtitan.dtypes import DTYPES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a complete step-N checkpoint folder")
    parser.add_argument("output", help="output folder for model.safetensors and config.json")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's dtype")
    args = parser.parse_args(argv)
    try:
        config = export_to_hf(args.checkpoint, args.output, DTYPES.get(args.dtype))
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.output}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
        f"{config['torch_dtype']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
