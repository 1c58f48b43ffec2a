"""Convert Hugging Face weights (any family with an adapter: docs/models.md) to a seed checkpoint a run starts from.

    python scripts/convert_from_hf.py HF_DIR outputs/my_run/checkpoint/step-0 [--model qwen3]

HF_DIR holds ``model.safetensors`` and ``config.json``; the model family is the one for the config's
``model_type`` unless ``--model`` names it (a Qwen3.5 multimodal folder, ``qwen3_5``, is ``qwen3_5_vl``: tower and
language model; ``--model qwen3_5`` reads its language model alone). The output is a complete step-0 (weights
only) checkpoint: a run with ``checkpoint.enable_checkpoint = true`` and that checkpoint folder loads
it as its initial weights (every key and shape is checked against the configured model).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from torchtitan.checkpointing.hf.convert import import_from_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", help="folder with model.safetensors and config.json")
    parser.add_argument("output", help="output checkpoint folder, e.g. <dump_folder>/checkpoint/step-0")
    parser.add_argument(
        "--model", default=None, help="model.name of the family (default: from config.json's model_type)"
    )
    args = parser.parse_args(argv)
    try:
        import_from_hf(args.hf_dir, args.output, model_name=args.model)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
