"""Image-text fine-tuning data (docs/vision.md): chat rows with local images.

The images are processed with transformers' image processor for the family, and packed with per-sample
multimodal positions.
"""
