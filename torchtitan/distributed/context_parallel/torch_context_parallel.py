"""Context parallel with torch's own ring attention (``experimental.context_parallel_impl = "torch"``).

torch (2.11 to 2.15) ships ring attention for SDPA on DTensors sharded along the sequence
(``torch.distributed.tensor.experimental._context_parallel``): with its dispatcher enabled, SDPA on
``Shard(2)`` q/k/v runs ``_templated_ring_attention`` (allgather or alltoall rotation, the same
head + mirrored-tail load balancing as ours). It only registers ring handlers for the CUDA
kernels (flash, efficient, cuDNN). On CPU, SDPA dispatches to
``_scaled_dot_product_flash_attention_for_cpu``, for which this module registers the two missing
handlers (forward and backward), written against the same private templates. Everything here rests
on private torch names, so it is limited to the releases checked (``check_torch_cp_supported`` in distributed/context_parallel/checks.py) and tested on CPU
against one process (tests/distributed/test_context_parallel.py, the ``cp2_torch`` matrix row).
Our own ring (context_parallel.py) stays the portable default.

The model is the same as with our ring: ``TorchRingAttention`` replaces each block's ``sdpa``
module, receives this rank's load-balanced q/k/v shards (the trainer shards the batch with
``compute_cp_positions``, which is torch's round-robin layout) and returns this rank's output rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from torchtitan.distributed.backend.dtensor import local_shard
from torchtitan.distributed.context_parallel.checks import check_torch_cp_supported
from torchtitan.distributed.context_parallel.context_parallel import is_sink_kernel
from torchtitan.models.common.attention import repeat_kv

_SEQ_DIM = 2  # (bs, heads, seqlen, head_dim)
_aten = torch.ops.aten
_CPU_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _cp_attention():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def _wrap(local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A Shard(2) DTensor over ``mesh`` around a rank's local result (inside DTensor dispatch)."""
    shape = list(local.shape)
    shape[_SEQ_DIM] *= mesh.size()
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, (Shard(_SEQ_DIM),), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _cpu_forward_handler(op_call, args, kwargs):
    """The CPU flash kernel's ring: (out, logsumexp), both Shard(2). Mirrors torch's CUDA handlers."""
    query, key, value, *rest = args
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None or dropout_p:
        raise NotImplementedError("context_parallel_impl = 'torch' on CPU: no attn_mask or dropout")
    mesh = query.device_mesh
    out, lse = _cp_attention()._templated_ring_attention(
        mesh.get_group(),
        _SEQ_DIM,
        _CPU_FORWARD,
        local_shard(query),
        local_shard(key),
        local_shard(value),
        is_causal=is_causal,
        dropout_p=0.0,
        scale=kwargs.get("scale"),
    )
    return _wrap(out, mesh), _wrap(lse, mesh)


def _cpu_backward_handler(op_call, args, kwargs):
    """(grad_q, grad_k, grad_v), each Shard(2), from torch's ring backward template."""
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    mesh = query.device_mesh
    grads = _cp_attention()._templated_ring_attention_backward(
        mesh.get_group(),
        _SEQ_DIM,
        _CPU_BACKWARD,
        grad_out=local_shard(grad_out),
        grad_out_name="grad_out",
        query=local_shard(query),
        key=local_shard(key),
        value=local_shard(value),
        out=local_shard(out),
        logsumexp=local_shard(logsumexp),
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=kwargs.get("scale"),
    )
    return tuple(_wrap(g, mesh) for g in grads[:3])


def enable_torch_cp_dispatcher() -> None:
    """Route SDPA on DTensors to torch's ring handlers, plus ours for the CPU kernel (idempotent)."""
    check_torch_cp_supported()
    attention = _cp_attention()
    attention.custom_ops[_CPU_FORWARD] = _cpu_forward_handler
    attention.custom_ops[_CPU_BACKWARD] = _cpu_backward_handler
    attention._enable_cp_dtensor_dispatcher()


class TorchRingAttention(nn.Module):
    """Drop-in for CausalAttention on a rank's load-balanced sequence shard, via torch's ring attention.

    torch's ring reads its options from process-wide state; they are set on every call, so two
    models with different settings in one process stay correct (backward reuses the last ones).
    """

    def __init__(self, cp_mesh: DeviceMesh, *, rotate_method: str, load_balance: bool):
        super().__init__()
        self.cp_mesh, self.rotate_method, self.load_balance = cp_mesh, rotate_method, load_balance

    def extra_repr(self) -> str:
        return f"cp={self.cp_mesh.size()}, rotate_method={self.rotate_method}, load_balance={self.load_balance}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (bs, n_heads, s, d); k, v (bs, n_kv_heads, s, d) -> (bs, n_heads, s, d), this rank's rows."""
        if v.shape[-1] != q.shape[-1]:
            # CPU SDPA runs v heads of another width on its math kernel, which torch's ring does not handle
            raise NotImplementedError(
                f"context_parallel_impl = 'torch' with v heads {v.shape[-1]} wide and q/k heads {q.shape[-1]} "
                "(multi-head latent attention): use context_parallel_impl = 'portable'"
            )
        attention = _cp_attention()
        attention._cp_options.enable_load_balance = self.load_balance
        attention.set_rotate_method(self.rotate_method)
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])  # torch's ring passes the expanded heads (ours the kv heads)
        q, k, v = (DTensor.from_local(t, self.cp_mesh, [Shard(_SEQ_DIM)], run_check=False) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).to_local()


def apply_torch_cp(model: nn.Module, cp_mesh: DeviceMesh, *, rotate_method: str, load_balance: bool) -> None:
    """Swap every block's ``attention.sdpa`` for TorchRingAttention (None layers of a PP stage skipped).

    Raises:
        NotImplementedError: a block's kernel takes attention sinks (gpt-oss): torch's ring has none.
    """
    enable_torch_cp_dispatcher()
    for block in model.layers.values():
        if block is None:
            continue
        if is_sink_kernel(block.attention.sdpa):
            raise NotImplementedError(
                "context_parallel_impl = 'torch' with attention sinks and sliding windows (gpt_oss): torch's "
                "ring attention has neither; use context_parallel_impl = 'portable'"
            )
        block.attention.sdpa = TorchRingAttention(cp_mesh, rotate_method=rotate_method, load_balance=load_balance)
