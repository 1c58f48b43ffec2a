"""Model families as pure nn.Modules (torch only). Each family's folder holds its modules and
flavors; the registry that wires a family to the trainer is ``torchtitan/spec.py``."""

from torchtitan.models.llama import ModelArgs, Transformer

__all__ = ["ModelArgs", "Transformer"]
