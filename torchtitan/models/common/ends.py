"""The ends of a layered model: the modules before and after its ``layers`` ModuleDict, and what passes between
its blocks.

Either end may be None: a pipeline stage holds the input modules only with its first layers and the output modules
only with its last (distributed/pipeline/stages.py ``prune_to_stage`` sets the others to None), and in between it
takes and returns the hidden state, whose shape the memory estimator reads from ``hidden_dims``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ModelEnds:
    """llama's ends (a mixin of its ``Transformer``); a subclass with more lists them: an image model's vision tower
    beside the embedding, DeepSeek-V4's collapse of its residual streams before the final norm."""

    input_modules: ClassVar[tuple[str, ...]] = ("tok_embeddings",)
    output_modules: ClassVar[tuple[str, ...]] = ("norm", "output")

    @staticmethod
    def hidden_dims(args: Any) -> tuple[int, ...]:
        """The hidden state's dims after (bs, seqlen) between blocks: ``(dim,)``."""
        return (args.dim,)


def model_ends(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input modules, output modules) of a layered model: its own lists, llama's for a model without them (a family
    defined outside the package, built on ``nn.Module`` alone)."""
    return (
        getattr(model, "input_modules", ModelEnds.input_modules),
        getattr(model, "output_modules", ModelEnds.output_modules),
    )


def hidden_dims(model_cls: type, args: Any) -> tuple[int, ...]:
    """The hidden state's dims after (bs, seqlen): the model class's ``hidden_dims``, else ``(args.dim,)``."""
    return model_cls.hidden_dims(args) if hasattr(model_cls, "hidden_dims") else (args.dim,)
