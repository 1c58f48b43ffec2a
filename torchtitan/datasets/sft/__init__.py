"""Supervised fine-tuning data: chat templates, examples with their loss masks, and packing.

Import from the modules (chat_template, examples, packing): this init imports nothing, so importing
the package costs nothing (as torchtitan/datasets/__init__.py). See docs/sft.md.
"""
