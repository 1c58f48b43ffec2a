"""Model families: what is specific to each, in one record (``ModelSpec``), and the registry.

The trainer, metrics, validation, checkpointing, the conversion scripts and the memory estimator
reach a family only through its spec (``get_model_spec(config.model.name)``), so nothing outside
``models/<family>/`` asks ``isinstance(args, SomeArgs)``. A family is its folder under ``models/``:
pure nn.Modules, flavors, an optional Hugging Face adapter, and ``spec.py``, which holds its
``ModelSpec`` (``SPEC``, or ``SPECS`` by name when the module holds two) and its own checks. This
module holds only the protocol and the registry, one line per family naming that module (``_FAMILIES``),
imported on the family's first ``get_model_spec``: the family modules import this one, and the config
check reads only the family it runs. Families that keep llama's module layout (``tok_embeddings``,
``layers``, ``norm``, ``output``; the TP plan's names) use the default parallelize and pipeline split.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.pipeline.layout import check_pipeline
from torchtitan.distributed.tensor_parallel.checks import check_tp_shapes

if TYPE_CHECKING:
    import torch

    from torchtitan.config.manager import JobConfig
    from torchtitan.config.schema import Model
    from torchtitan.distributed.mesh import OuterSum
    from torchtitan.distributed.parallel_dims import ParallelDims


ANY_HF_MODEL_TYPE = "*"


class Deferred:
    """A function named by ``"module:attribute"``, imported on its first call.

    The registry is read by the pre-launch config check (``python -m torchtitan.preflight``, before
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
PRUNE_TO_STAGE = Deferred("torchtitan.distributed.pipeline.stages:prune_to_stage")


class StepHooks(Protocol):
    """A family's per-step work beside forward/backward (MoE load balancing, for one)."""

    def aux_loss(self, model_part: nn.Module, scale: float) -> torch.Tensor | None:
        """A loss term, already multiplied by the micro-batch's ``scale``, to back-propagate with its loss; or None."""

    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        """After backward, before the step is applied (or dropped): reduce the step's statistics; every rank
        calls it (may communicate). ``outer_sum``: fault tolerance's sum over the replica groups, or None."""

    def after_optimizer_step(self) -> None:
        """Called on every rank after each optimizer step (may communicate within the world)."""

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

    def reduce_step(self, *, keep_metrics: bool, outer_sum: OuterSum | None) -> None:
        for h in self.hooks:
            h.reduce_step(keep_metrics=keep_metrics, outer_sum=outer_sum)

    def after_optimizer_step(self) -> None:
        for h in self.hooks:
            h.after_optimizer_step()

    def discard_step(self) -> None:
        for h in self.hooks:
            h.discard_step()

    def metrics(self) -> tuple[dict[str, Any], dict[str, float]] | None:
        return merge_metrics(*(h.metrics() for h in self.hooks))


def merge_metrics(*parts: tuple[dict[str, Any], dict[str, float]] | None) -> tuple[dict, dict] | None:
    """Several (record fields, TensorBoard scalars) pairs as one; None if there are none."""
    found = [m for m in parts if m is not None]
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


class StateDictAdapter(Protocol):
    """A family's Hugging Face conversion (``ModelSpec.state_dict_adapter``; the shared mapping is
    models/common/hf_adapter.py's ``HfAdapter``). ``args``: our model args as a dict."""

    @property
    def block_names(self) -> Mapping[str, str]:
        """Our suffix -> HF suffix, per block (LoRA's targets and PEFT's module names are read from it)."""
        ...

    def to_hf_state_dict(self, sd: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Our weights (all, or some) -> HF names and layouts; ValueError for a weight without an HF name."""
        ...

    def from_hf_state_dict(self, hf: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, torch.Tensor]:
        """HF weights (all, or some) -> ours; ValueError for a weight the family does not know."""
        ...

    def hf_config(self, args: dict[str, Any], weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for our args and weights, saved in ``dtype``."""
        ...

    def model_args_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        """Our model args (as a dict) from ``config.json``; ValueError / NotImplementedError for what we lack."""
        ...


@dataclass(frozen=True)
class AdapterLayout:
    """Where LoRA adapts a family's linears and their PEFT names: the attention linears of its HF block map, and
    the FFNs at ``ffn_paths``."""

    block_names: Mapping[str, str]
    """Our suffix -> HF suffix per block (its adapter's ``block_names``): LoRA's targets and PEFT's module names."""
    ffn_paths: tuple[str, ...]
    """Where its plain-nn.Linear FFNs sit in a block (w1/w2/w3 under each): a dense family's one FFN; an MoE
    family's dense layers' and shared expert's. Routed experts (grouped weights) and the router are never adapted."""
    dense: bool = False
    """A dense family (no experts): QLoRA (``lora.quantize_base``) runs on it, and no name is an expert's."""
    peft_ffn_remapped: bool = False
    """peft re-targets gate_proj/up_proj/down_proj of this model type onto its fused routed experts, so a PEFT
    export of FFN adapters would load onto other weights (peft 0.21 on transformers 5: deepseek_v3)."""
    linears: Callable[[nn.Module], list[str]] | None = None
    """A family whose targets are read from its blocks, not listed (``hf``: each model's own module names): a block
    -> the paths of the linears LoRA may adapt; a target's name, ours and PEFT's alike, is its module's
    (``q_proj``). ``block_names`` and ``ffn_paths`` are then empty."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    Fields:
        name: ``model.name`` in the config.
        model_cls: built as ``model_cls(args)`` on the meta device.
        flavors: ``model.flavor`` -> frozen args dataclass (with ``n_layers``, ``dim``, ``n_heads``,
            ``head_dim``, ``vocab_size``, ``max_seq_len``, ``norm_type``, ``attention_backend``).
        parallelize_fn: ``(model, *, world_mesh, parallel_dims, training, experimental,
            activation_checkpoint, float8) -> None`` (the config sections it reads): every parallelism,
            in place, in the family's documented order (default: ``distributed.parallelize``).
        pipeline_split_fn: ``(meta_model, first_layer, end_layer, is_first, is_last) -> None``:
            prune a fresh meta model to one pipeline stage in place (default: llama-style
            ``prune_to_stage``); None: no pipeline parallel.
        count_flop_params: ``(args, meta_model) -> int``: the parameters one token is multiplied
            by (the N of MFU's 6N; default: every parameter but the embedding table).
        build_step_hooks: ``(args, meta_model, model_parts, world, device, *, shape_inference) -> StepHooks |
            None`` (``shape_inference``: the pipeline's ``ShapeInference``, whose forwards a hook must not count).
        fake_tensor_args: ``args -> args`` to build under fake tensors (the memory estimator):
            data-dependent choices replaced by a fixed assumption; None: the args as they are.
        fake_tensor_context: ``() -> context manager`` the memory estimator runs the fake build and step in:
            the family's own code adapted to fake tensors where it reads values, changing no shape (the ``hf``
            family's transformers masks); None: none.
        state_dict_adapter: the Hugging Face conversion of the family (a ``StateDictAdapter``,
            models/common/hf_adapter.py), or None.
        adapters: where LoRA adapts the family's linears and their PEFT names (``AdapterLayout``, read by
            lora/names.py); None: LoRA is not built for the family.
        check_fn: ``(args, *, model, training, experimental) -> list[str]``: the family's own
            pre-launch checks of the flavor's ``args`` against the config sections (``Model``,
            ``Training``, ``Experimental``), beside the generic ones: raise ConfigError /
            NotImplementedError naming the key; return warnings.
        layer_pattern: ``args -> (prefix, period)``: after ``prefix`` leading layers, the layers
            repeat with this period (the estimator extrapolates memory over whole periods).
        hf_model_type: the Hugging Face ``model_type`` a ``config.json`` names for this family (``"*"``: any; the
            ``hf`` family builds transformers' own class for it; ``spec_for_hf_model_type`` picks it only with
            ``any_family``, where no other family reads the model_type).
        hf_wrapper_model_type: the ``model_type`` of a published multimodal folder whose ``text_config`` and
            language-model weights the family also imports (Qwen3.5's ``"qwen3_5"``); None: none.
        hf_refusal: ``args -> str | None`` (``args`` a dict: a flavor's, or a checkpoint marker's): why
            such weights have no Hugging Face counterpart, one line ending in the fix; None where they
            convert. Read through ``hf_conversion_refusal`` (the pre-launch check and the converters).
        configure: ``(flavor_args, model: Model) -> args``: the args of the flavor under the run's ``[model]`` section
            (the ``hf`` family reads ``model.hf_config``); None: the flavor's args as listed.
        config_vocab: ``args -> int | None``: the vocabulary a model config of the user's gave those args (the ``hf``
            family's ``model.hf_config`` setting ``vocab_size``), which the embedding keeps (checkpointing/hf/files.py
            ``vocab_rows``: at least the tokenizer's words, else refused before launch); None (or no function): the
            flavor names none, and the tokenizer's words size the embedding.
        documents: the family's forward takes ``doc_ids`` (and per-row ``positions``) and passes them to
            every block's attention, so ``model.attn_mask_type = "block_causal"`` can run on it; its
            args then have an ``attention_backend`` field (``build_model_args`` sets it).
    """

    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    parallelize_fn: Callable[..., None] = PARALLELIZE
    count_flop_params: Callable[[Any, nn.Module], int] = count_non_embedding_params
    pipeline_split_fn: Callable[[nn.Module, int, int, bool, bool], None] | None = PRUNE_TO_STAGE
    build_step_hooks: Callable[..., StepHooks | None] | None = None
    fake_tensor_args: Callable[[Any], Any] | None = None
    fake_tensor_context: Callable[[], AbstractContextManager] | None = None
    state_dict_adapter: StateDictAdapter | None = None
    adapters: AdapterLayout | None = None
    check_fn: Callable[..., list[str]] | None = None
    layer_pattern: Callable[[Any], tuple[int, int]] = lambda args: (0, 1)
    hf_model_type: str | None = None  # config.json's "model_type" this family imports (with state_dict_adapter)
    hf_wrapper_model_type: str | None = None
    hf_refusal: Callable[[Mapping[str, Any]], str | None] | None = None
    documents: bool = False
    configure: Callable[[Any, Model], Any] | None = None
    config_vocab: Callable[[Any], int | None] | None = None

    def flavor_args(self, model: Model) -> Any:
        """The args of ``model.flavor`` under the run's ``[model]`` section (``configure``)."""
        flavor = self.flavors[model.flavor]
        return flavor if self.configure is None else self.configure(flavor, model)

    def reads_hf_model_type(self, model_type: str | None) -> bool:
        """Whether this family imports a Hugging Face ``config.json`` of ``model_type``."""
        read = (self.hf_model_type, self.hf_wrapper_model_type)
        return self.hf_model_type == ANY_HF_MODEL_TYPE or (model_type is not None and model_type in read)


def hf_conversion_refusal(spec: ModelSpec, args: Mapping[str, Any], *, export: bool = True) -> str | None:
    """Why weights of ``spec``'s family with ``args`` (a dict) do not convert to (``export``) or from
    Hugging Face, in one line ending in the fix; None when they do."""
    why = spec.hf_refusal(args) if spec.hf_refusal is not None else None
    if spec.state_dict_adapter is None:
        return why or f"model.name = {spec.name!r} has no Hugging Face conversion (its spec has no state_dict_adapter)"
    # An import is exact whatever this says: a buffer HF has no weight for starts at its initial value.
    return why if export else None


# One line per family: model.name -> the module whose ``SPEC`` (or ``SPECS[name]``) is its ModelSpec.
# Imported on first use (the family modules import this one).
_FAMILIES: dict[str, str] = {
    "llama3": "torchtitan.models.llama.spec",
    "llama3_moe": "torchtitan.models.moe.spec",
    "qwen3": "torchtitan.models.qwen3.spec",
    "qwen3_moe": "torchtitan.models.qwen3.spec",
    "deepseek_v3": "torchtitan.models.deepseek_v3.spec",
    "deepseek_v32": "torchtitan.models.deepseek_v32.spec",
    "deepseek_v4": "torchtitan.models.deepseek_v4.spec",
    "gpt_oss": "torchtitan.models.gpt_oss.spec",
    "qwen3_5": "torchtitan.models.qwen3_5.spec",
    "qwen3_5_moe": "torchtitan.models.qwen3_5.spec",
    "qwen3_5_vl": "torchtitan.models.qwen3_5.spec",
    "qwen3_5_moe_vl": "torchtitan.models.qwen3_5.spec",
    "hf": "torchtitan.models.hf.spec",
}
_SPECS: dict[str, ModelSpec] = {}  # loaded from _FAMILIES, or registered with register_model_spec


def register_model_family(name: str, module: str) -> None:
    """Add a family by the module holding its spec (imported on first use), as a ``_FAMILIES`` line does."""
    if name in model_names() and _FAMILIES.get(name) != module:
        raise ValueError(f"a model family named {name!r} is already registered")
    _FAMILIES[name] = module


def register_model_spec(spec: ModelSpec) -> None:
    """Add a family (e.g. one defined outside the package); a name is registered once."""
    if spec.name in model_names() and get_model_spec(spec.name) is not spec:
        raise ValueError(f"a model family named {spec.name!r} is already registered")
    _SPECS[spec.name] = spec


def model_names() -> list[str]:
    """Every registered family's name (imports none of them)."""
    return list(dict.fromkeys([*_FAMILIES, *_SPECS]))


def _load(name: str) -> ModelSpec:
    module_name = _FAMILIES[name]
    module = importlib.import_module(module_name)
    specs = getattr(module, "SPECS", None)
    if specs is None and hasattr(module, "SPEC"):
        specs = {module.SPEC.name: module.SPEC}
    spec = (specs or {}).get(name)
    if spec is None or spec.name != name:
        raise ValueError(
            f"model family {name!r} is registered as {module_name}, which defines no ModelSpec named {name!r}; "
            "give it SPEC = ModelSpec(name, ...) (or SPECS = {name: ModelSpec(name, ...)})"
        )
    return spec


def get_model_spec(name: str) -> ModelSpec:
    """The family's spec (importing its module the first time)."""
    if name not in _SPECS:
        if name not in _FAMILIES:
            raise ValueError(f"model.name = {name!r} is unknown; registered families: {model_names()}")
        _SPECS[name] = _load(name)
    return _SPECS[name]


def flavor_args(model: Model) -> Any:
    """The args ``model.flavor`` names in ``model.name``'s family, as listed (before ``build_model_args``).

    Raises:
        ConfigError: an unknown family or flavor, naming the key and what is allowed.
    """
    try:
        flavors = get_model_spec(model.name).flavors
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model.flavor not in flavors:
        raise ConfigError(f"model.flavor = {model.flavor!r} is not a {model.name} flavor; allowed are {list(flavors)}")
    return get_model_spec(model.name).flavor_args(model)


def spec_for_hf_model_type(model_type: str, *, any_family: bool = False) -> ModelSpec:
    """The family that imports a Hugging Face ``config.json`` of this ``model_type`` (imports every family): the one
    whose own model_type it is, else one that imports such a folder's language model; with ``any_family``, when no
    family of ours does, the one that builds transformers' own class for any model_type (``model.name = 'hf'``:
    ``scripts/generate.py --hf`` on what that family trains and exports).

    Raises:
        ValueError: no family imports it (without ``any_family``).
    """
    specs = [get_model_spec(name) for name in model_names()]
    # the family that reads the folder whole (its own model_type) before one that reads its language model
    # (hf_wrapper_model_type: Qwen3.5's multimodal folder -> qwen3_5_vl, not the text qwen3_5)
    for spec in sorted(specs, key=lambda s: s.hf_model_type != model_type):
        if spec.hf_model_type != ANY_HF_MODEL_TYPE and spec.reads_hf_model_type(model_type):
            return spec
    if any_family:
        for spec in specs:
            if spec.hf_model_type == ANY_HF_MODEL_TYPE:
                return spec
    known = sorted(s.hf_model_type for s in specs if s.hf_model_type and s.hf_model_type != ANY_HF_MODEL_TYPE)
    raise ValueError(f"Hugging Face model_type {model_type!r} has no model family here; known: {known}")


def check_model(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: ``model.name`` and ``model.flavor`` exist; the flavor's shapes against the layout (heads under
    TP: distributed/tensor_parallel/checks.py; stages under PP: distributed/pipeline/layout.py); the family's own check (FFN
    width under TP, experts); ``training.seq_len`` fits the flavor."""
    args = flavor_args(config.model)
    spec = get_model_spec(config.model.name)
    check_tp_shapes(args, model=config.model, training=config.training)
    check_pipeline(args, model=config.model, training=config.training, experimental=config.experimental)
    warnings = []
    if spec.check_fn is not None:
        warnings += spec.check_fn(args, model=config.model, training=config.training, experimental=config.experimental)
    if config.model.freeze_vision and not hasattr(spec.model_cls, "freeze_vision"):
        raise ConfigError(
            f"model.freeze_vision = true with model.name = {config.model.name!r}: the family has no vision tower; "
            "use an image family (qwen3_5_vl, qwen3_5_moe_vl) or drop the key"
        )
    if config.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"training.seq_len = {config.training.seq_len} does not fit model {config.model.flavor}, whose "
            f"max_seq_len is {args.max_seq_len}; lower training.seq_len"
        )
    return warnings
