"""DeepSeek-V4 ("deepseek_v4") wired to the trainer: its ModelSpec, and the layouts it refuses before launch.

It reuses the MoE families' wiring (models/moe/spec.py: the expert-parallel check, active-parameter count,
balanced routing under fake tensors, the load balancer). Not part of the pure model: this module may import
``torchtitan.spec``; ``torchtitan.spec`` loads it on the first ``get_model_spec("deepseek_v4")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchtitan.config.errors import ConfigError
from torchtitan.distributed.pipeline.layout import resolve_stage_layout
from torchtitan.models.deepseek_v4 import DeepSeekV4Transformer, deepseek_v4_configs
from torchtitan.models.deepseek_v4.args import CSA, HASH_MOE
from torchtitan.models.deepseek_v4.hf_adapter import ADAPTER
from torchtitan.models.moe.spec import MOE_WIRING, check_moe_config
from torchtitan.spec import ModelSpec

if TYPE_CHECKING:
    from torchtitan.config.schema import Experimental, Model, Training


def check_deepseek_v4_config(args: Any, *, model: Model, training: Training, experimental: Experimental) -> list[str]:
    """What V4's layers cannot be built under yet (one line each, naming why), a pipeline split with a hash_moe layer
    past the first stage, an index_topk the sequence cannot make sparse, then the MoE check.

    Returns:
        warnings; raises NotImplementedError naming the key, ConfigError for the index_topk.
    """
    named = f"model.name = 'deepseek_v4' (flavor {model.flavor!r})"
    exp = experimental
    refused = [
        (
            training.tensor_parallel_degree > 1,
            f"training.tensor_parallel_degree = {training.tensor_parallel_degree} with {named}: V4's attention has "
            "one shared key/value head, hyper-connection streams and a grouped output projection that no TP plan of "
            "ours shards yet; use training.tensor_parallel_degree = 1 (FSDP and expert parallel compose)",
        ),
        (
            exp.context_parallel_degree > 1,
            f"experimental.context_parallel_degree = {exp.context_parallel_degree} with {named}: the compressors "
            "pool windows of the whole sequence and the indexer ranks all of a query's entries, which a sequence "
            "shard cannot see; use context_parallel_degree = 1",
        ),
        (
            model.attn_mask_type == "block_causal",
            f"model.attn_mask_type = 'block_causal' with {named}: the compressed entries pool across document "
            "boundaries (transformers' model has no documents either); use attn_mask_type = 'causal'",
        ),
    ]
    for bad, message in refused:
        if bad:
            raise NotImplementedError(message)
    _check_hash_layers_on_first_stage(args, named, experimental)
    entries = training.seq_len // args.csa_rate  # compressed entries the last query of a sequence can rank
    if CSA in args.layer_types and args.index_topk >= entries:
        raise ConfigError(
            f"{named}: index_topk = {args.index_topk} >= training.seq_len // csa_rate = {training.seq_len} // "
            f"{args.csa_rate} = {entries}: every query would keep every compressed entry, so the compressed-sparse "
            f"layers would attend densely; allowed: index_topk < seq_len // csa_rate; set training.seq_len > "
            f"{args.index_topk * args.csa_rate} or a flavor with a smaller index_topk"
        )
    warnings = check_moe_config(args, model=model, training=training, experimental=experimental)
    if model.attention_backend != "auto":
        warnings.append(
            f"model.attention_backend = {model.attention_backend!r} has no effect on deepseek_v4: its attention "
            "(sinks, window, compressed entries) always runs its own masked-softmax kernel"
        )
    return warnings


def _check_hash_layers_on_first_stage(args: Any, named: str, exp: Experimental) -> None:
    """Pipeline parallel: every hash_moe layer on the first stage, the only one that receives the token ids (later
    stages receive the hc_mult streams); NotImplementedError naming the first layer that is not."""
    if exp.pipeline_parallel_degree == 1:
        return
    stages = resolve_stage_layout(
        args.n_layers,
        exp.pipeline_parallel_degree,
        exp.pipeline_parallel_schedule,
        exp.pipeline_parallel_split_points,
        exp.pipeline_parallel_schedule_csv,
    )
    hashed = [i for i, kind in enumerate(args.mlp_layer_types) if kind == HASH_MOE]
    late = [(i, s) for i in hashed for s, (first, end) in enumerate(stages) if s > 0 and first <= i < end]
    if not late:
        return
    layer, stage = late[0]
    first, end = stages[stage]
    start = hashed[-1] + 1  # the earliest layer a later stage may start at
    fix = (
        f"put layers 0..{hashed[-1]} on stage 0: experimental.pipeline_parallel_split_points starting at "
        f"layers.{start} or later, or fewer stages (a lower pipeline_parallel_degree, or a single-stage schedule)"
        if start < args.n_layers
        else "the last layer is hash-routed, so no split keeps it on stage 0: use pipeline_parallel_degree = 1"
    )
    raise NotImplementedError(
        f"experimental.pipeline_parallel_degree = {exp.pipeline_parallel_degree} with {named}: hash_moe layer "
        f"{layer} falls on pipeline stage {stage} (layers {first}..{end - 1}), but hash routing reads the token "
        f"ids, which only stage 0 receives; {fix}"
    )


def deepseek_v4_layer_pattern(args: Any) -> tuple[int, int]:
    """(prefix, period): after ``prefix`` layers the (attention, MLP) kinds repeat with ``period``, at least twice;
    the shortest prefix + period, else the whole stack as one period."""
    kinds = list(zip(args.layer_types, args.mlp_layer_types))
    n = len(kinds)
    found = [
        (prefix, period)
        for prefix in range(n)
        for period in range(1, (n - prefix) // 2 + 1)
        if all(kinds[i] == kinds[i + period] for i in range(prefix, n - period))
    ]
    return min(found, key=sum, default=(0, max(n, 1)))


SPEC = ModelSpec(
    "deepseek_v4",
    DeepSeekV4Transformer,
    deepseek_v4_configs,
    **{
        **MOE_WIRING,
        "documents": False,
        "check_fn": check_deepseek_v4_config,
        "layer_pattern": deepseek_v4_layer_pattern,
    },
    state_dict_adapter=ADAPTER,
    hf_model_type="deepseek_v4",
)
