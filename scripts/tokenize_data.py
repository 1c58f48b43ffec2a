"""Tokenize a corpus once into Megatron-LM's indexed dataset format (PREFIX.bin + PREFIX.idx).

Train on it with ``--training.dataset_path PREFIX`` or blend it with ``--training.dataset_mix`` (docs/data.md).
The output is byte-identical whatever --workers is, and is what megatron-core's IndexedDatasetBuilder writes
for the same documents; an interrupted run leaves only ``PREFIX.*.partial`` files, which a rerun overwrites.

Usage:
    python scripts/tokenize_data.py --input torchtitan/datasets/assets/pydocs/pydocs.jsonl \
        --output_prefix /tmp/pydocs_text_document [--tokenizer PATH] [--workers N] [--text_key text]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from torchtitan.datasets.indexed.tokenize import tokenize_to_indexed  # noqa: E402
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a .jsonl/.json/.parquet file or folder, or a cached HF dataset")
    parser.add_argument("--output_prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument(
        "--tokenizer", default=str(REPO / DEFAULT_TOKENIZER_PATH), help="the run's model.tokenizer_path"
    )
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (the output is the same)")
    parser.add_argument("--text_key", default="text", help="the column holding each document's text")
    args = parser.parse_args(argv)
    try:
        summary = tokenize_to_indexed(
            args.input, args.output_prefix, args.tokenizer, workers=args.workers, text_key=args.text_key
        )
    except KeyboardInterrupt:
        print("tokenize_data.py: interrupted; nothing written under the output names", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"tokenize_data.py: error: {e}", file=sys.stderr)
        return 2
    print(summary.line(args.output_prefix, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
