"""QLoRA (Dettmers et al. 2023): the frozen base linears that carry adapters stored as NF4 (``lora.quantize_base``).

Each target linear's weight becomes torchao's ``NF4Tensor``: 4-bit NormalFloat codes in blocks of 64 elements, each
block's absmax scale double-quantized to int8 in groups of 256 blocks (one fp32 factor per group, one mean per
tensor). ``F.linear`` on it dequantizes the weight for that call only (torchao's ``LinearNF4``), and its backward
gives the input's gradient, never the weight's. Everything else (embedding, norms, head, the adapters) stays in
the run's dtype.

When: after the base is loaded (``checkpoint.initial_load_path``, a resume's base, or the seeded init), so the load
path, its checks and its sharded reads are LoRA's own. Under FSDP2 each weight is gathered whole once (one layer's
fp32 at a time), quantized whole on every rank, and each rank keeps its dim-0 chunk of the NF4 tensor (torchao's
split of the codes, scales and factors): the bytes are those of the one-process quantization on every layout, and
FSDP all-gathers the NF4 codes and scales (``NF4Tensor.fsdp_pre_all_gather``), not fp32. That needs every chunk to
hold whole groups of 64 x 256 elements (``check_nf4_shapes``, before launch).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable

import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.observability.logging import quiet_torchao_notes

# torchao's (and the QLoRA paper's) defaults: 64 elements share a scale, 256 scales share an fp32 factor
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_GROUP = NF4_BLOCK * NF4_SCALER_BLOCK  # elements per fp32 factor: a tensor (or FSDP chunk) holds whole groups
TORCHAO_PIN = "torchao==0.18.0"


logger = logging.getLogger(__name__)


def nf4_bytes(numel: int, factor_bytes: int = 4) -> int:
    """Bytes of one NF4 tensor of ``numel`` elements: 4-bit codes (0.5 B/element), an int8 scale per 64 elements,
    a ``factor_bytes`` factor per 64 x 256 elements, the fp32 mean and torchao's 16-entry fp32 code table."""
    return numel // 2 + numel // NF4_BLOCK + factor_bytes * (numel // NF4_GROUP) + 4 + 16 * 4


def check_torchao_for_nf4(quantize_base: str) -> None:
    """``lora.quantize_base = 'nf4'`` needs torchao (found, not imported: it is slow to import)."""
    if quantize_base == "nf4" and importlib.util.find_spec("torchao") is None:
        raise NotImplementedError(
            "lora.quantize_base = 'nf4' needs torchao, which is not installed; pip install 'torchtitan[lora]' "
            f"(or {TORCHAO_PIN})"
        )


def check_nf4_shapes(shapes: dict[str, tuple[int, int]], shards: int) -> None:
    """Every target weight (and its FSDP chunk over ``shards`` ranks) holds whole groups of 64 x 256 elements."""
    for name, (out, inp) in shapes.items():
        if out % shards or (out // shards) * inp % NF4_GROUP:
            raise ConfigError(
                f"lora.quantize_base = 'nf4': target {name} is ({out}, {inp}); NF4 quantizes groups of {NF4_GROUP} "
                f"elements and each of the {shards} FSDP shard(s) must hold whole groups; take it out of "
                "lora.target_modules, another flavor or fewer FSDP ranks"
            )


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (a whole 2-D tensor) as torchao's NF4Tensor, with the QLoRA paper's block sizes."""
    quiet_torchao_notes()
    from torchao.quantization import to_nf4 as _to_nf4

    return _to_nf4(weight.detach().contiguous(), block_size=NF4_BLOCK, scaler_block_size=NF4_SCALER_BLOCK)


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` quantized to NF4 and dequantized (in its dtype): what a QLoRA run's forward uses as its base."""
    return to_nf4(weight.float()).get_original_weight().to(weight.dtype)


def is_nf4(t: torch.Tensor) -> bool:
    """A (local) NF4Tensor, or a DTensor over one (by name: no torchao import)."""
    return type(getattr(t, "_local_tensor", t)).__name__ == "NF4Tensor"


@torch.no_grad()
def quantize_linear_weight(linear: nn.Linear) -> None:
    """Replace ``linear.weight`` (frozen; plain, or an FSDP Shard(0) DTensor) by its NF4 form, in place."""
    from torch.distributed.tensor import DTensor  # not at import: the pre-launch checks import this module

    w = linear.weight
    if not isinstance(w, DTensor):
        linear.weight = nn.Parameter(to_nf4(w), requires_grad=False)
        return
    if w.device_mesh.ndim != 1 or not w.placements[0].is_shard(0):
        raise NotImplementedError(
            f"lora.quantize_base: a weight placed {w.placements} on a {w.device_mesh.ndim}-D mesh"
        )
    nf4 = to_nf4(w.full_tensor())  # the whole weight on every rank: the one-process bytes
    local = torch.chunk(nf4, w.device_mesh.size(), dim=0)[w.device_mesh.get_local_rank()]  # whole groups each
    # The old DTensor's spec (mesh, Shard(0), global shape): FSDP2 takes the new local tensor at its lazy init
    # (FSDPParam.reset_sharded_param, as after load_state_dict(assign=True)) and all-gathers through its extension.
    linear.weight = nn.Parameter(DTensor(local, w._spec, requires_grad=False), requires_grad=False)


def quantize_base(model_parts: Iterable[nn.Module]) -> int:
    """Every LoRALinear's base weight in ``model_parts`` as NF4; returns how many. Call before the first forward
    (FSDP2's lazy init registers the new sharded parameters)."""
    from torchtitan.features.lora.linear import LoRALinear

    count = 0
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, LoRALinear) and not is_nf4(module.weight):
                quantize_linear_weight(module)
                count += 1
        _hand_nf4_shards_to_fsdp(part)
    return count


def _hand_nf4_shards_to_fsdp(part: nn.Module) -> None:
    """FSDP2's lazy init re-reads a swapped parameter (``reset_sharded_param``), but first compares the storage of
    its old flat shard with the new local tensor's, which a wrapper subclass (NF4Tensor) has none of; torch skips
    that comparison when the flat shard is not a plain tensor, so it is pointed at the NF4 shard here (torch 2.13
    private state; the rest of the re-registration is FSDP's own)."""
    from torch.distributed.fsdp import FSDPModule

    for module in part.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else []:
            info = fsdp_param._module_info
            local = getattr(info.module, info.param_name)._local_tensor
            if is_nf4(local):
                fsdp_param._sharded_param_data = local.view(-1)


def quantize_loaded_base(core) -> None:
    """The ``after_load`` seam of ``lora.quantize_base = 'nf4'`` (features/registry.py): the frozen base just
    loaded becomes NF4, before the first forward."""
    n = quantize_base(core.model_parts)
    if core.rank == 0:
        logger.info("lora.quantize_base = 'nf4': %d frozen base linears stored as NF4", n)
