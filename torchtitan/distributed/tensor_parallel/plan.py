"""Tensor parallel with sequence parallel and loss parallel, as plans of ParallelStyles.

Layouts (tp = the TP degree):
* Between blocks the residual stream is sequence-sharded: a local (bs, seq/tp, dim) tensor.
* Norms run sequence-parallel (their weights replicated), so no rank normalises another's tokens.
* Attention / feed-forward inputs are all-gathered along the sequence once, then wq/wk/wv/w1/w3
  are column-parallel (each rank computes n_heads/tp heads, hidden/tp units) and wo/w2 are
  row-parallel with a reduce-scatter back to sequence shards. Per block: 2 all-gathers and 2
  reduce-scatters forward (and the same backward), no all-reduce.
* The embedding is row-parallel over the vocabulary (a rank owns vocab/tp rows), its output
  reduce-scattered to sequence shards; the output projection is column-parallel over the vocab.
  With loss parallel the logits stay vocab-sharded and cross-entropy runs under
  ``loss_parallel()`` (never materialising full logits on one rank); without, they are gathered.

The model is unchanged: attention reads its local head count from tensor shapes.

MoE blocks (``moe_block_plan``): attention as above, but the MoE keeps the sequence-sharded
tokens: each TP rank routes its own seq/tp tokens (expert parallel, which contains the TP ranks,
moves them to their experts). The router gate and the shared expert keep replicated weights and
see their inputs as token-sharded DTensors, so their grads come out Partial and are summed over
TP like the norms' (grad_norm.reduce_partial_grads_).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.distributed.tensor_parallel.async_tp import AsyncColwiseParallel, AsyncRowwiseParallel
from torchtitan.distributed.tensor_parallel.linear_attention import (
    gated_delta_plan,
    is_gated_delta,
    shard_gated_delta_heads,
)
from torchtitan.distributed.tensor_parallel.module_styles import with_module_styles
from torchtitan.distributed.tensor_parallel.replicated import TokenShardedReplicate
from torchtitan.distributed.tensor_parallel.vision import embedding_plan, replicate_tower
from torchtitan.models.moe import MoE


def top_level_plan(loss_parallel: bool) -> dict[str, ParallelStyle]:
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # A DTensor output is what loss_parallel's cross-entropy consumes.
            use_local_output=not loss_parallel,
        ),
    }


def block_plan(float8: bool = False) -> dict[str, ParallelStyle]:
    """Synchronous TP + SP for one transformer block.

    float8: the block's linears are torchao ``Float8Linear`` (tensorwise): torchao's float8 styles
    cast the attention / FFN input to float8 *before* the sequence all-gather (half the bytes of
    bf16) and the row-parallel output gradients before theirs.
    """
    colwise, rowwise, prepare_input = _styles(float8)
    return {
        "attention_norm": SequenceParallel(),
        # rope (the second input) is a plain per-position table, the same on every rank.
        "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": colwise(),
        "attention.wk": colwise(),
        "attention.wv": colwise(),
        "attention.wo": rowwise(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": colwise(),
        "feed_forward.w2": rowwise(output_layouts=Shard(1)),
        "feed_forward.w3": colwise(),
    }


def apply_tp_inference(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor parallel without sequence parallel, for generation (a step may hold a single token).

    Activations between blocks stay replicated: column-parallel q/k/v and w1/w3, row-parallel wo/w2
    whose outputs are all-reduced; the embedding and the head shard the vocabulary and return
    replicated outputs (the logits whole on every rank). Dense blocks only.
    """
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
    }
    embedding, output = model.tok_embeddings, model.output
    tied = output.weight is embedding.weight
    parallelize_module(model, tp_mesh, top)
    if tied:
        output.weight = embedding.weight
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            raise NotImplementedError("tensor-parallel generation of an MoE model: run it on one process")
        plan = {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()}
        plan |= {"feed_forward.w2": RowwiseParallel()}
        if is_gated_delta(block.attention):
            parallelize_module(block, tp_mesh, plan | gated_delta_plan(sequence_parallel=False))
            shard_gated_delta_heads(block.attention, tp_mesh)
            continue
        plan |= {name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv")}
        plan |= {"attention.wo": RowwiseParallel()}
        if getattr(block.attention, "q_norm", None) is not None:
            plan |= {"attention.q_norm": TokenShardedReplicate(2), "attention.k_norm": TokenShardedReplicate(2)}
        parallelize_module(block, tp_mesh, plan)


def _styles(float8: bool) -> tuple[type, type, type]:
    if not float8:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _all_float8(block: nn.Module, names: list[str]) -> bool:
    """Whether every linear the plan names is a torchao Float8Linear (a filtered one keeps the plain styles)."""
    from torchao.float8.float8_linear import Float8Linear

    return all(isinstance(block.get_submodule(n), Float8Linear) for n in names)


class LatentReplicate(ParallelStyle):
    """Replicated weights applied to the whole (all-gathered) sequence: MLA's down-projections and their norms.

    The input is this rank's copy of the full sequence (Replicate); the output is a plain tensor that
    feeds column-parallel up-projections, whose input hooks all-reduce its gradient over TP, so the
    weight's gradient is complete and the same on every rank (Replicate). ``sync_tail``: the last
    features of the output do not go through a column-parallel layer (MLA's RoPE key, shared by every
    head): each rank's heads add only their share to its gradient, so those features pass an identity
    whose backward all-reduces over TP.
    """

    def __init__(self, sync_tail: int = 0):
        super().__init__()
        self.sync_tail = sync_tail

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Replicate()])))

        def to_dtensor(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                for x in inputs
            )

        def to_local(mod: nn.Module, out: DTensor, mesh: DeviceMesh):
            local = out.to_local()
            if not self.sync_tail:
                return local
            head, tail = local.split([local.shape[-1] - self.sync_tail, self.sync_tail], dim=-1)
            # forward: the identity; backward: the heads' partial gradients summed over TP (Partial -> Replicate)
            tail = DTensor.from_local(tail, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
            return torch.cat([head, tail], dim=-1)

        return distribute_module(module, device_mesh, replicate, input_fn=to_dtensor, output_fn=to_local)


def mla_attention_plan(attention: nn.Module) -> dict[str, ParallelStyle]:
    """Multi-head latent attention (DeepSeek-V3) under TP + SP: the latent down-projections (wq_a, wkv_a) and
    their norms replicated on the gathered sequence, the per-head up-projections (wq or wq_b, wkv_b)
    column-parallel over heads, wo row-parallel back to sequence shards."""
    plan: dict[str, ParallelStyle] = {
        "attention.wkv_a": LatentReplicate(sync_tail=attention.qk_rope_head_dim),
        "attention.kv_norm": LatentReplicate(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.wq is not None:
        return {**plan, "attention.wq": ColwiseParallel()}
    q_plan = {"attention.wq_a": LatentReplicate(), "attention.q_norm": LatentReplicate()}
    return {**plan, **q_plan, "attention.wq_b": ColwiseParallel()}


def is_mla(attention: nn.Module) -> bool:
    return getattr(attention, "wkv_b", None) is not None


def shard_sinks(attention: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Attention sinks (gpt-oss: one logit per query head) sharded like the heads wq computes: Shard(0)."""
    sinks = getattr(attention, "sinks", None)
    if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
        attention.sinks = nn.Parameter(distribute_tensor(sinks.data, tp_mesh, [Shard(0)]))


def moe_block_plan(has_shared_expert: bool, has_shared_gate: bool = False) -> dict[str, ParallelStyle]:
    """TP + SP for an MoE block: llama's attention plan; the MoE works on the local sequence shard."""
    plan = {k: v for k, v in block_plan().items() if not k.startswith("feed_forward")}
    # ffn_norm's output is a Shard(1) DTensor; the MoE gets its local (bs, seq/tp, dim) part and
    # returns the same shape, which is the residual stream's layout already.
    plan["feed_forward"] = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    plan["feed_forward.router.gate"] = TokenShardedReplicate()
    if has_shared_expert:
        plan["feed_forward.shared_expert"] = TokenShardedReplicate()
    if has_shared_gate:
        plan["feed_forward.shared_expert_gate"] = TokenShardedReplicate()
    return plan


def async_block_plan() -> dict[str, ParallelStyle]:
    """TP + SP whose all-gathers and reduce-scatters overlap the matmuls (our ring, any backend).

    The norms' sequence-sharded outputs go straight into the column-parallel linears, which gather
    them chunk by chunk while multiplying; one shared style per consumer group gathers the input
    once for wq/wk/wv (and once for w1/w3).
    """
    attention_in, ffn_in = AsyncColwiseParallel(), AsyncColwiseParallel()
    return {
        "attention_norm": SequenceParallel(),
        "attention.wq": attention_in,
        "attention.wk": attention_in,
        "attention.wv": attention_in,
        "attention.wo": AsyncRowwiseParallel(),
        "ffn_norm": SequenceParallel(),
        "feed_forward.w1": ffn_in,
        "feed_forward.w2": AsyncRowwiseParallel(),
        "feed_forward.w3": ffn_in,
    }


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, ring_async: bool, float8: bool = False
) -> None:
    """Shard ``model`` in place over ``tp_mesh``. Submodules a pipeline stage dropped (None) are skipped.

    float8: use torchao's float8 styles in blocks whose linears were all converted (tensorwise
    recipe); the embedding and the output head stay in high precision and keep the plain styles.
    """
    tower = getattr(model, "visual", None)  # an image model: the tower replicated (vision.py)
    top = top_level_plan(loss_parallel) | (embedding_plan() if tower is not None else {})
    plan = {k: v for k, v in top.items() if getattr(model, k, None) is not None}
    embedding, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = embedding is not None and output is not None and output.weight is embedding.weight
    frozen = frozen_names(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:
        # Each style distributed its own copy of the one table; both are Shard(0) over the vocab,
        # so the head takes the embedding's DTensor and the two stay one parameter.
        output.weight = embedding.weight
    if tower is not None:
        replicate_tower(tower, tp_mesh)
    for block in model.layers.values():
        apply_block_tp(block, tp_mesh, ring_async=ring_async, float8=float8)
    for depth in (getattr(model, "mtp", None) or {}).values():  # multi-token prediction's depths
        apply_block_tp(depth.block, tp_mesh, ring_async=ring_async, float8=float8)
        parallelize_module(depth, tp_mesh, mtp_depth_plan())
    refreeze(model, frozen)


def apply_block_tp(block: nn.Module, tp_mesh: DeviceMesh, *, ring_async: bool, float8: bool) -> None:
    """Shard one transformer block in place by the plan its attention and feed-forward call for."""
    mla = is_mla(block.attention)
    if (isinstance(block.feed_forward, MoE) or mla) and ring_async:
        raise NotImplementedError(
            "experimental.enable_async_tensor_parallel with an MoE model or multi-head latent attention: the "
            "async plan has neither; turn async TP off"
        )
    if isinstance(block.feed_forward, MoE):
        moe = block.feed_forward
        plan = moe_block_plan(moe.shared_expert is not None, moe.shared_expert_gate is not None)
    elif ring_async:
        plan = async_block_plan()
    elif mla:  # MLA's dense blocks: the plain styles (its linears are not all wq/wk/wv)
        plan = block_plan()
    else:
        linears = [k for k in block_plan() if k.count(".") == 1]
        plan = block_plan(float8=float8 and _all_float8(block, linears))
    plan = _attention_plan(block.attention, plan, mla)
    parallelize_module(block, tp_mesh, with_module_styles(plan, block))  # e.g. adapted linears: adapters alike
    shard_sinks(block.attention, tp_mesh)
    if is_gated_delta(block.attention):
        shard_gated_delta_heads(block.attention, tp_mesh)


def mtp_depth_plan() -> dict[str, ParallelStyle]:
    """An MTP depth's own modules (models/common/mtp.py ``MTPDepth``; its block takes ``apply_block_tp``): all
    per-token, so all sequence-parallel with replicated weights, their gradients Partial like the block norms'.

    Inputs: the embedding of the tokens ahead, plain (bs, seq/tp, dim) (the embedding's output layout), and the
    previous hidden state, the final norm's Shard(1) DTensor (depth 1) or a block's plain sequence shard. enorm
    and hnorm return Shard(1) DTensors, whose concatenation on the last dim stays Shard(1); eh_proj returns the
    plain sequence shard the block's residual stream is; norm's Shard(1) output is what the shared output head
    (``top_level_plan``) takes, so each depth's logits come out as the model's (vocab-sharded under loss parallel).
    """
    return {
        "enorm": SequenceParallel(),
        "hnorm": SequenceParallel(),
        "eh_proj": SequenceParallel(use_local_output=True),
        "norm": SequenceParallel(),
    }


def _attention_plan(attention: nn.Module, plan: dict[str, ParallelStyle], mla: bool) -> dict[str, ParallelStyle]:
    """The block plan's attention entries for this block's token mixer: multi-head latent attention's, Gated
    DeltaNet's (linear_attention.py), or llama's with the QK-norm's where the attention has one."""
    if mla or is_gated_delta(attention):
        plan = {k: v for k, v in plan.items() if not k.startswith("attention.")}
        return plan | (mla_attention_plan(attention) if mla else gated_delta_plan())
    if getattr(attention, "q_norm", None) is not None:  # QK-norm: (bs, seqlen, local heads, head_dim) per rank
        return {**plan, "attention.q_norm": TokenShardedReplicate(2), "attention.k_norm": TokenShardedReplicate(2)}
    return plan


def frozen_names(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def refreeze(model: nn.Module, frozen: set[str]) -> None:
    """torch's SequenceParallel re-creates the weights it replicates as trainable: a frozen one (LoRA's base) is
    frozen again, before FSDP wraps it."""
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
