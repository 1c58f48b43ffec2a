"""Reinforcement learning after fine-tuning (GRPO, DAPO): the RL step over the trainer's parts (docs/rl.md)."""
