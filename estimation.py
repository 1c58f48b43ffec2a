"""Memory estimator for a training config (placeholder until its issue lands).

It will build the model, parallelisms, optimizer and a batch through the trainer's own build
functions under FakeTensorMode with a fake process group, and report per-rank peak memory.
"""

import sys

if __name__ == "__main__":
    print(
        "error: estimation.py is not yet available; see the open issue 'estimation.py: a memory "
        "estimator for every parallelism'",
        file=sys.stderr,
    )
    sys.exit(2)
