"""The RL feature's builders (the registry's slots with ``rl.enable``): the prompts as the run's data, the frozen
reference among the step's modules, and the step itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan.build import finish_model_part
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.features.rl.prompts import PromptSource
from torchtitan.features.rl.step import RLStep

if TYPE_CHECKING:
    from torchtitan.components.parts import CoreParts
    from torchtitan.config.manager import JobConfig

REFERENCE = "rl_reference"
"""The frozen reference's name among the step's modules (and its key in the checkpoints)."""


def build_prompt_source(config: JobConfig, tokenizer: Any, shard: Any, model_args: Any = None) -> PromptSource:
    """The ``data_loader`` slot with ``rl.enable``: the prompts file, read through the chat template."""
    chat = ChatTokenizer(config.model.tokenizer_path, base=tokenizer)
    return PromptSource.of_run(config.rl, config.training, chat)


def build_reference(core: CoreParts, *, meta_model: Callable[[Any, Any], nn.Module]) -> dict[str, nn.Module]:
    """The ``step_modules`` slot: with ``rl.kl_coef`` > 0, a second copy of the model under the same layout and
    transforms, frozen (filled from the policy at a fresh start, from the checkpoint on a resume); ``meta_model``:
    the run's builder of a meta model (the estimator's builds it outside fake mode)."""
    if core.config.rl.kl_coef <= 0:
        return {}
    reference = meta_model(core.spec, core.model_args)
    finish_model_part(
        reference, core.spec, core.config, core.world, core.device, transforms=core.transforms, frozen=True
    )
    return {REFERENCE: reference}


def build_rl_step(core: CoreParts, *, modules: Mapping[str, nn.Module], start_step: int, **seams: Any) -> RLStep:
    """The ``step_runner`` slot with ``rl.enable`` (``seams``: the agreement, gradients and guard)."""
    reference = modules.get(REFERENCE)
    if reference is not None and start_step == 0:  # the policy as the run starts, frozen
        _copy_weights(core.model_parts[0], reference)
    step = RLStep(core, reference=reference, start_step=start_step, **seams)
    step.open_outside()
    return step


@torch.no_grad()
def _copy_weights(source: nn.Module, target: nn.Module) -> None:
    for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True):
        b.copy_(a)
