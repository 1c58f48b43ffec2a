"""Convert a DCP checkpoint folder into one ``torch.save`` file (all entries, full tensors).

    python scripts/dcp_to_torch.py outputs/debug_model/checkpoint/step-30 step30.pt [--model-only]

Uses torch's ``dcp_to_torch_save``. Read the result with ``torch.load(path, weights_only=True)``
(with --model-only it holds only tensors; a full checkpoint also holds the LR scheduler's and data
loader's plain Python values). Only convert checkpoints you trust: DCP metadata is unpickled.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from torchtitan.checkpointing import MARKER, load_model_weights, read_marker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step-N checkpoint folder")
    parser.add_argument("output", help="the .pt file to write")
    parser.add_argument("--model-only", action="store_true", help="only the model weights, as {fqn: tensor}")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        print(f"error: checkpoint folder {args.checkpoint!r} does not exist", file=sys.stderr)
        return 2
    if read_marker(args.checkpoint) is None:
        print(
            f"error: {args.checkpoint} is incomplete (no {MARKER} marker: its save did not finish); "
            "convert a complete step-N folder",
            file=sys.stderr,
        )
        return 2
    if args.model_only:
        try:
            weights, _ = load_model_weights(args.checkpoint)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        torch.save(weights, args.output)
    else:
        dcp_to_torch_save(args.checkpoint, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
