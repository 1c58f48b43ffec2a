"""Reinforcement learning after fine-tuning (GRPO, DAPO): a second driver over the trainer's built parts (docs/rl.md)."""
