"""Upstream torchtitan's configs read as ours: 2025's TOML keys, 2026's recipe functions.

2025: keys_2025 (the key table), spellings (per source), resolve_2025 (what needs every source). 2026: upstream_2026
(the names recipes import), keys_2026 (each Trainer.Config field's rule), read_2026 (the translation).
"""
