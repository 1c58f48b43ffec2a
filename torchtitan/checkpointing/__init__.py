"""Checkpointing: DCP save/resume of the whole training state, seed checkpoints, weight export.

See docs/checkpoint.md for the layout on disk, the resume and resharding guarantees and integrity
(CRC32s taken while writing and checked on load; pickles restricted to DCP's types: integrity.py).
Import from the modules (manager, files/, hf/, common, checks): this init imports nothing,
so the pre-launch checks (checks.py) load without DCP.
"""
