"""Model families as pure nn.Modules (torch only), a folder each.

Each family's folder holds its modules, flavors,
Hugging Face adapter and ``spec.py``: the family's ``ModelSpec`` and checks, the one file that wires it
to the trainer (it may import ``torchtitan.spec``); ``torchtitan/spec.py`` names it in the registry.
"""

from torchtitan.models.llama import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer"]
