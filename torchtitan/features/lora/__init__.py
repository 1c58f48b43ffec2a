"""LoRA fine-tuning: adapters on a frozen base (``[lora]``, docs/lora.md).

``names.py`` maps target names (ours and PEFT's) per family; ``apply.py`` is the model transform (after the
meta build, before the parallelisms); ``checks.py`` the pre-launch check; ``peft_io.py`` PEFT folders in and out.
The module itself is ``torchtitan.features.lora.linear.LoRALinear``; its TP styles ``lora/tensor_parallel.py``.
"""
