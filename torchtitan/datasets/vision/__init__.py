"""Image-text fine-tuning data (docs/vision.md): chat rows with local images, processed with transformers' image
processor for the family, packed with per-sample multimodal positions."""
