"""Weight init that is a function of the seed, not of the parallel layout.

Every rank draws each parameter's *full* tensor from the same RNG stream, in the same order, and
keeps the slice its placement owns. So a sharded (FSDP/TP) parameter ends up holding exactly the
values the single-process init gives that slice. The model's own ``init_weights`` code is used
unchanged: a TorchFunctionMode intercepts, on DTensor parameters, the ``nn.init`` functions that
defer to modes (normal_, uniform_, ...) and the in-place random fills the others bottom out in
(trunc_normal_ is uniform_ followed by elementwise math, which then runs shard-locally).
The RNG is reseeded per init unit (embedding, each block, norm, output), so a pipeline stage that
owns only some units draws the same values for them as the whole model.

Cost: each rank generates every parameter it holds at full size, one at a time (peak extra memory =
the largest single parameter). That is cheap next to a training step, and it is what makes loss
parity and resume-on-another-layout possible.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

from torchtitan.models.common.init import LOW_PRECISION

# In-place random fills whose result does not depend on the tensor's old values.
_RANDOM_FILLS = {
    torch.Tensor.uniform_,
    torch.Tensor.normal_,
    torch.Tensor.random_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.log_normal_,
    torch.Tensor.cauchy_,
    torch.Tensor.geometric_,
}


class _FullTensorInitMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        # nn.init functions that defer to modes pass the tensor by keyword.
        param = args[0] if args else kwargs.get("tensor")
        is_init = func in _RANDOM_FILLS or getattr(func, "__module__", None) == "torch.nn.init"
        low_precision = isinstance(param, torch.Tensor) and param.dtype in LOW_PRECISION
        if not (is_init and (isinstance(param, DTensor) or low_precision)):
            return func(*args, **kwargs)
        # Drawn in fp32 even for bf16 parameters (training.dtype): the same draws as an fp32 run, then rounded.
        local_device = param.to_local().device if isinstance(param, DTensor) else param.device
        full = torch.empty(param.shape, dtype=torch.float32 if low_precision else param.dtype, device=local_device)
        if args:
            func(full, *args[1:], **kwargs)  # the mode is off inside its own handler
        else:
            func(**{**kwargs, "tensor": full})
        if not isinstance(param, DTensor):
            return param.copy_(full)
        # src_data_rank=None: every rank already holds the full tensor, so no communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
        return param


@torch.no_grad()
def cast_parameters_(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every floating parameter of a meta (not yet materialised) ``model`` in ``dtype``: pure low-precision
    training (training.dtype). Buffers keep theirs (the RoPE table stays fp32). In place (``.data``), so a
    parameter shared by two modules (a tied output head) stays one parameter."""
    # Plain meta tensors like the rest of the meta model, also under the memory estimator's FakeTensorMode (a fake
    # tensor cannot become a meta parameter's data).
    with unset_fake_temporarily():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)


def unit_seed(seed: int, unit_name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(unit_name.encode())) % (2**63)


@torch.no_grad()
def init_model_weights(model: nn.Module, seed: int, buffer_device: torch.device) -> None:
    """Initialise a materialised (``to_empty``) model so its values depend only on ``seed``.

    ``model`` must provide ``init_buffers(device)`` and ``init_units()`` (see models/llama/model.py).
    The global RNG is left reseeded from ``seed``.
    """
    model.init_buffers(buffer_device)
    init_named_units(model.init_units(), seed)


@torch.no_grad()
def init_named_units(units: Iterable[tuple[str, Callable[[], None]]], seed: int) -> None:
    """Run each ``(name, init)`` with the RNG reseeded from ``seed`` and the name, every DTensor drawn at full
    size (the module docstring); e.g. LoRA's adapters (torchtitan/features/lora/apply.py), named by their FQNs. The
    global RNG is left reseeded from ``seed``."""
    with _FullTensorInitMode():
        for name, init in units:
            torch.manual_seed(unit_seed(seed, name))
            init()
    torch.manual_seed(seed)
