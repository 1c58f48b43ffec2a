"""Data: tokenizers and the stateful, parallel-layout-invariant text pipeline.

Import from the modules (hf_datasets, registry, tokenizer, checks): this init imports nothing, so the
pre-launch checks (checks.py) load without the data stack.
"""
