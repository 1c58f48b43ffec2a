"""Convert a DCP checkpoint folder into one ``torch.save`` file (all entries, full tensors).

    python scripts/dcp_to_torch.py outputs/debug_model/checkpoint/step-30 step30.pt [--model-only]

Loads what torch's ``dcp_to_torch_save`` would, after checking every file against the marker (sizes,
CRC32s) and with the restricted unpicklers of torchtitan/checkpointing/files/integrity.py (a foreign
pickle is refused, not run). Read the result with ``torch.load(path, weights_only=True)`` (with
--model-only it holds only tensors; a full checkpoint also holds the LR scheduler's and data
loader's plain Python values).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from torchtitan.checkpointing.common import load_model_weights  # noqa: E402
from torchtitan.checkpointing.files.folders import (
    CheckpointInfo,  # noqa: E402
    verify_files,  # noqa: E402
)
from torchtitan.checkpointing.files.integrity import load_whole_checkpoint  # noqa: E402
from torchtitan.checkpointing.files.marker import MARKER, read_marker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step-N checkpoint folder")
    parser.add_argument("output", help="the .pt file to write")
    parser.add_argument("--model-only", action="store_true", help="only the model weights, as {fqn: tensor}")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        print(f"error: checkpoint folder {args.checkpoint!r} does not exist", file=sys.stderr)
        return 2
    marker = read_marker(args.checkpoint)
    if marker is None:
        print(
            f"error: {args.checkpoint} is incomplete (no {MARKER} marker: its save did not finish); "
            "convert a complete step-N folder",
            file=sys.stderr,
        )
        return 2
    try:
        if args.model_only:
            state, _ = load_model_weights(args.checkpoint)
        else:
            verify_files(CheckpointInfo(marker.get("step", -1), args.checkpoint, marker))
            state = load_whole_checkpoint(args.checkpoint)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.save(state, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
