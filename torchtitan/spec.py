"""Model families: what is specific to each, in one record (``ModelSpec``), and the registry.

The trainer, metrics, validation, checkpointing, the conversion scripts and the memory estimator
reach a family only through its spec (``get_model_spec(config.model.name)``), so nothing outside
``models/<family>/`` and this registry asks ``isinstance(args, SomeArgs)``. A new family is its
folder under ``models/`` (pure nn.Modules, flavors, an optional Hugging Face adapter) plus one
entry in ``_SPECS`` below; families that keep llama's module layout (``tok_embeddings``,
``layers``, ``norm``, ``output``; the TP plan's names) use the default parallelize and pipeline
split. ``models/`` stays pure torch: the wiring to distributed code lives here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.models.llama import Transformer, hf_adapter, llama3_configs
from torchtitan.models.llama.model import ffn_hidden_dim
from torchtitan.models.moe import MoETransformer, moe_configs, num_active_params
from torchtitan.models.qwen3 import Qwen3MoETransformer, Qwen3Transformer, qwen3_configs, qwen3_moe_configs
from torchtitan.models.qwen3 import hf_adapter as qwen3_hf_adapter
from torchtitan.models.qwen3 import hf_moe_adapter as qwen3_moe_hf_adapter

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.mesh import WorldMesh
    from torchtitan.distributed.parallel_dims import ParallelDims


class Deferred:
    """A function named by ``"module:attribute"``, imported on its first call.

    The registry is read by the pre-launch config check (``python -m torchtitan.config``, before
    every launch), which needs the flavors, not the distributed stack a family's wiring imports
    (``torch.distributed.pipelining`` alone pulls in dynamo: seconds per launch).
    """

    def __init__(self, target: str):
        self.target = target
        self._fn: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            module, _, name = self.target.partition(":")
            self._fn = getattr(importlib.import_module(module), name)
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Deferred({self.target!r})"


PARALLELIZE = Deferred("torchtitan.distributed.parallelize:parallelize")
PRUNE_TO_STAGE = Deferred("torchtitan.distributed.pipeline:prune_to_stage")


class StepHooks(Protocol):
    """A family's per-step work beside forward/backward (MoE load balancing, for one)."""

    def aux_loss(self, model_part: nn.Module, scale: float) -> torch.Tensor | None:
        """A loss term, already multiplied by the micro-batch's ``scale``, to back-propagate with its loss; or None."""

    def after_optimizer_step(self, *, keep_metrics: bool) -> None:
        """Called on every rank after each optimizer step (may communicate)."""

    def discard_step(self) -> None:
        """Called on every rank instead of ``after_optimizer_step`` when the step's update is dropped."""

    def metrics(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        """(record fields, TensorBoard scalars) of the last log step, or None."""


class HookChain:
    """Several ``StepHooks`` as one (the family's and, e.g., float8's), called in order."""

    def __init__(self, hooks: list[StepHooks]):
        self.hooks = hooks

    def aux_loss(self, model_part: nn.Module, scale: float) -> torch.Tensor | None:
        terms = [t for t in (h.aux_loss(model_part, scale) for h in self.hooks) if t is not None]
        return sum(terms[1:], terms[0]) if terms else None

    def after_optimizer_step(self, *, keep_metrics: bool) -> None:
        for h in self.hooks:
            h.after_optimizer_step(keep_metrics=keep_metrics)

    def discard_step(self) -> None:
        for h in self.hooks:
            h.discard_step()

    def metrics(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        found = [m for m in (h.metrics() for h in self.hooks) if m is not None]
        if not found:
            return None
        return {k: v for fields, _ in found for k, v in fields.items()}, {k: v for _, s in found for k, v in s.items()}


def chain_hooks(*hooks: StepHooks | None) -> StepHooks | None:
    present = [h for h in hooks if h is not None]
    return None if not present else present[0] if len(present) == 1 else HookChain(present)


def count_non_embedding_params(args: Any, model: nn.Module) -> int:
    """Global (unsharded) parameter count without the embedding table: what the matmuls touch.

    A table tied to the output head stays in: the head's matmul uses it (``parameters()`` counts it once).
    """
    total = sum(p.numel() for p in model.parameters())
    embed, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    if embed is None or (output is not None and output.weight is embed.weight):
        return total
    return total - embed.weight.numel()


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    Fields:
        name: ``model.name`` in the config.
        model_cls: built as ``model_cls(args)`` on the meta device.
        flavors: ``model.flavor`` -> frozen args dataclass (with ``n_layers``, ``dim``, ``n_heads``,
            ``head_dim``, ``vocab_size``, ``max_seq_len``, ``norm_type``, ``attention_backend``).
        parallelize_fn: ``(model, world_mesh, parallel_dims, config) -> None``: every parallelism,
            in place, in the family's documented order (default: ``distributed.parallelize``).
        pipeline_split_fn: ``(meta_model, first_layer, end_layer, is_first, is_last) -> None``:
            prune a fresh meta model to one pipeline stage in place (default: llama-style
            ``prune_to_stage``); None: no pipeline parallel.
        count_flop_params: ``(args, meta_model) -> int``: the parameters one token is multiplied
            by (the N of MFU's 6N; default: every parameter but the embedding table).
        build_step_hooks: ``(args, meta_model, model_parts, device) -> StepHooks | None``.
        fake_tensor_args: ``args -> args`` to build under fake tensors (the memory estimator):
            data-dependent choices replaced by a fixed assumption; None: the args as they are.
        state_dict_adapter: the Hugging Face conversion of the family (``to_hf_state_dict``,
            ``from_hf_state_dict``, ``hf_config``, ``model_args_from_hf``), or None.
        validate_fn: ``(config, args) -> None``: the family's own pre-launch checks (raise
            ConfigError / NotImplementedError naming the key), beside the generic ones.
        layer_pattern: ``args -> (prefix, period)``: after ``prefix`` leading layers, the layers
            repeat with this period (the estimator extrapolates memory over whole periods).
        hf_model_type: the Hugging Face ``model_type`` a ``config.json`` names for this family.
        documents: the family's forward takes ``doc_ids`` (and per-row ``positions``) and passes them to
            every block's attention, so ``model.attn_mask_type = "block_causal"`` can run on it; its
            args then have an ``attention_backend`` field (``build_model_args`` sets it).
    """

    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    parallelize_fn: Callable[[nn.Module, DeviceMesh | None, ParallelDims, JobConfig], None] = PARALLELIZE
    count_flop_params: Callable[[Any, nn.Module], int] = count_non_embedding_params
    pipeline_split_fn: Callable[[nn.Module, int, int, bool, bool], None] | None = PRUNE_TO_STAGE
    build_step_hooks: Callable[[Any, nn.Module, list[nn.Module], WorldMesh, torch.device], StepHooks | None] | None = (
        None
    )
    fake_tensor_args: Callable[[Any], Any] | None = None
    state_dict_adapter: Any = None
    validate_fn: Callable[[JobConfig, Any], None] | None = None
    layer_pattern: Callable[[Any], tuple[int, int]] = lambda args: (0, 1)
    hf_model_type: str | None = None  # config.json's "model_type" this family imports (with state_dict_adapter)
    documents: bool = False


def _moe_flop_params(args: Any, model: nn.Module) -> int:
    return num_active_params(args, model)  # top_k of the routed experts


def _balanced_routing(args: Any) -> Any:
    # Routing is data-dependent; under fake tensors every expert gets an equal share of the tokens.
    return dataclasses.replace(args, balanced_routing=True)


def _check_dense_config(config: JobConfig, args: Any) -> None:
    """The FFN width under TP (llama's formula, or a family's ``ffn_dim``); no expert parallel without experts."""
    tp, ep = config.training.tensor_parallel_degree, config.experimental.expert_parallel_degree
    hidden = getattr(args, "ffn_dim", None) or ffn_hidden_dim(args)
    if hidden % tp:
        raise ConfigError(
            f"model {config.model.flavor}: ffn hidden size = {hidden} is not divisible by "
            f"training.tensor_parallel_degree = {tp}; choose a TP degree that divides it"
        )
    if ep > 1 and not hasattr(args, "num_experts"):
        raise ConfigError(
            f"experimental.expert_parallel_degree = {ep} but model.name = {config.model.name!r} (flavor "
            f"{config.model.flavor!r}) has no experts; use an MoE family (llama3_moe) or set expert_parallel_degree = 1"
        )


def _check_moe_config(config: JobConfig, args: Any) -> None:
    """Expert parallel and the MoE model (the EP/TP/dp_shard divisibility is checked by ParallelDims)."""
    _check_dense_config(config, args)
    exp, t = config.experimental, config.training
    ep, tp = exp.expert_parallel_degree, t.tensor_parallel_degree
    model = f"model.name = {config.model.name!r} (flavor {config.model.flavor!r})"
    if ep < 1:
        raise ConfigError(f"experimental.expert_parallel_degree must be >= 1, got {ep}")
    if not 1 <= args.top_k <= args.num_experts:
        raise ConfigError(f"{model}: top_k = {args.top_k} must be between 1 and num_experts = {args.num_experts}")
    if args.num_experts % ep:
        raise ConfigError(
            f"{model} has num_experts = {args.num_experts}, not divisible by "
            f"experimental.expert_parallel_degree = {ep}; choose an EP degree that divides it"
        )
    unsupported = [
        (
            tp > 1 and ep == 1,
            f"training.tensor_parallel_degree = {tp} with experimental.expert_parallel_degree = 1: "
            "the routed experts are not tensor-parallel; set expert_parallel_degree to a multiple of tp (EP contains "
            "the TP ranks)",
        ),
        (
            exp.context_parallel_degree > 1 and ep > 1,
            f"experimental.expert_parallel_degree = {ep} with "
            f"experimental.context_parallel_degree = {exp.context_parallel_degree}: expert parallel does not include "
            "CP ranks yet; set one of them to 1",
        ),
        (
            t.compile,
            f"training.compile = true with {model}: the routed experts' fp32 grouped matmul and the EP "
            "all-to-all (data-dependent splits) do not compile under fullgraph; turn training.compile off",
        ),
        (
            exp.enable_async_tensor_parallel,
            f"experimental.enable_async_tensor_parallel with {model}: the async TP "
            "plan has no MoE block; turn async TP off",
        ),
        (
            args.load_balance == "aux_loss" and exp.pipeline_parallel_degree > 1,
            f"{model} balances with an aux "
            f"loss, and under experimental.pipeline_parallel_degree = {exp.pipeline_parallel_degree} the middle "
            "stages cannot add to the loss; use a flavor with load_balance = 'bias' or pipeline_parallel_degree = 1",
        ),
    ]
    for bad, message in unsupported:
        if bad:
            raise NotImplementedError(message)


# One entry per family.
_SPECS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        "llama3",
        Transformer,
        llama3_configs,
        documents=True,
        state_dict_adapter=hf_adapter,
        validate_fn=_check_dense_config,
        hf_model_type="llama",
    ),
    "qwen3": ModelSpec(
        "qwen3",
        Qwen3Transformer,
        qwen3_configs,
        documents=True,
        state_dict_adapter=qwen3_hf_adapter,
        validate_fn=_check_dense_config,
        hf_model_type="qwen3",
    ),
    "llama3_moe": ModelSpec(
        "llama3_moe",
        MoETransformer,
        moe_configs,
        documents=True,
        count_flop_params=_moe_flop_params,
        build_step_hooks=Deferred("torchtitan.components.load_balancing:build_load_balancer"),
        fake_tensor_args=_balanced_routing,
        validate_fn=_check_moe_config,
        layer_pattern=lambda args: (args.first_k_dense, args.moe_every),
    ),
    "qwen3_moe": ModelSpec(
        "qwen3_moe",
        Qwen3MoETransformer,
        qwen3_moe_configs,
        documents=True,
        count_flop_params=_moe_flop_params,
        build_step_hooks=Deferred("torchtitan.components.load_balancing:build_load_balancer"),
        fake_tensor_args=_balanced_routing,
        state_dict_adapter=qwen3_moe_hf_adapter,
        validate_fn=_check_moe_config,
        layer_pattern=lambda args: (args.first_k_dense, args.moe_every),
        hf_model_type="qwen3_moe",
    ),
}


def register_model_spec(spec: ModelSpec) -> None:
    """Add a family (e.g. one defined outside the package); a name is registered once."""
    if spec.name in _SPECS and _SPECS[spec.name] is not spec:
        raise ValueError(f"a model family named {spec.name!r} is already registered")
    _SPECS[spec.name] = spec


def model_names() -> list[str]:
    return list(_SPECS)


def spec_for_hf_model_type(model_type: str) -> ModelSpec:
    """The family that imports a Hugging Face ``config.json`` of this ``model_type``."""
    for spec in _SPECS.values():
        if spec.hf_model_type == model_type:
            return spec
    known = sorted(s.hf_model_type for s in _SPECS.values() if s.hf_model_type)
    raise ValueError(f"Hugging Face model_type {model_type!r} has no model family here; known: {known}")


def get_model_spec(name: str) -> ModelSpec:
    if name not in _SPECS:
        raise ValueError(f"model.name = {name!r} is unknown; registered families: {model_names()}")
    return _SPECS[name]
