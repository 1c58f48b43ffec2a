"""Model registry: name -> model class and flavors. Models here import only torch."""

from torchtitan.models.llama import ModelArgs, Transformer, llama3_configs
from torchtitan.models.moe import MoETransformer, moe_configs

model_name_to_cls = {"llama3": Transformer, "llama3_moe": MoETransformer}
model_name_to_flavors: dict[str, dict[str, ModelArgs]] = {"llama3": llama3_configs, "llama3_moe": moe_configs}
norm_types = ("rmsnorm", "layernorm", "np_layernorm")

__all__ = ["ModelArgs", "Transformer", "model_name_to_cls", "model_name_to_flavors", "norm_types"]
