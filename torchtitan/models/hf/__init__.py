"""Any transformers causal LM as a family (model.name = "hf"): docs/models.md."""
