"""Async tensor parallel on any backend: ring-decomposed collectives overlapped with matmuls.

Under sequence parallel a column-parallel linear needs the all-gathered input (``all_gather`` over
the sequence dim, then ``x_full @ W_local^T``) and a row-parallel linear ends in a reduce-scatter
over the sequence dim. Done synchronously, the matmul waits for the whole collective. Here both
are split into ``tp`` sequence chunks and run as a ring over the TP group with point-to-point
``isend``/``irecv`` (``dist.batch_isend_irecv``), so every transfer is in flight while a matmul
runs:

* **all-gather + matmul** (``AsyncColwiseParallel`` forward, ``AsyncRowwiseParallel`` backward).
  At step ``s`` a rank holds sequence chunk ``(rank - s) % tp``. It starts forwarding that chunk to
  ``rank + 1`` and receiving the next one from ``rank - 1``, multiplies the chunk it holds, and
  only then waits. ``tp - 1`` transfers, each hidden behind one chunk matmul.
* **matmul + reduce-scatter** (``AsyncRowwiseParallel`` forward, ``AsyncColwiseParallel``
  backward). At step ``s`` a rank computes its partial product for destination chunk
  ``(rank - s - 1) % tp`` while the running sum of the previous destination travels from its
  left neighbour; it adds that sum and sends the result on. After ``tp`` steps each rank holds the
  full sum of its own chunk.

The backward of each forward ring is the other ring, overlapped the same way; weight gradients
are accumulated chunk by chunk inside the ring steps, which lengthens the compute that hides each
transfer.

Shared input: wq/wk/wv (and w1/w3) consume the same normed activation. Give them ONE
``AsyncColwiseParallel`` instance: the first to run gathers the input (overlapped with its own
matmul) and hands the gathered tensor, keyed weakly by the input tensor object, to the others,
which multiply it without communicating. That gathered tensor is an autograd output of the first
linear, so its backward receives the summed gradient from all sharers and does ONE ring
reduce-scatter for them.

Memory: like sync TP, the gathered input (bs, seq, dim) is saved for backward (once per shared
input) and row-parallel linears save their full-sequence local input. Transfers add one chunk
buffer per step.

On CUDA, torch's own async TP (symmetric memory + the inductor micro-pipeline pass, which fuses
the collectives into the matmuls) is faster; this module is the portable version (gloo included)
and the reference for its numerics.

Under autocast the inputs are cast to the autocast dtype before the ring (so chunks travel in
the compute dtype) and the ring runs with autocast off, so its backward sees one dtype. The ring
code is eager Python with P2P ops; it has not been tried under torch.compile.

Float8: a linear converted to torchao's ``Float8Linear`` runs every GEMM of both rings in float8
(``torch._scaled_mm``), following the module's own ``config`` (tensorwise recipe; rowwise and the
other axiswise recipes raise NotImplementedError when the style is applied). The input, weight
and output gradient are each cast ONCE with a scale agreed over the TP group (an amax
all-reduce, as torchao's sync float8 TP styles get from DTensor), so the ring moves the float8
bytes (half of bf16, a quarter of fp32) and every chunk has the scale sync float8 TP would use.
The reduce-scatters sum high-precision partial products, as sync float8 TP does. Backward keeps
the float8 copies (the gathered input saved for backward is float8). Activation checkpointing
recomputes the same values; under autocast the operands are cast to the autocast dtype first.
Casts and GEMMs are in ``async_tp_float8``; the ring's point-to-point plumbing and its
instrumentation (``record_events``) in ``async_tp_ring``.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils.weak import WeakIdKeyDictionary

from torchtitan.distributed.tensor_parallel.async_tp_ring import (
    Ring,
    record_events,
    ring_all_gather,
    ring_reduce_scatter,
)

__all__ = ["AsyncColwiseParallel", "AsyncRowwiseParallel", "record_events"]

_SEQ_DIM = 1


def _seq_slice(chunk: int, chunk_len: int) -> slice:
    return slice(chunk * chunk_len, (chunk + 1) * chunk_len)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])  # (bs * seq, features)


def _zeros_like(weight: Tensor) -> Tensor:
    # not torch.zeros_like: a float8 weight (Float8TrainingTensor) has no such op
    return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)


class _Gemms:
    """The ring's casts, transfers and GEMMs in the operands' own precision (what nn.Linear does).

    ``async_tp_float8.Float8Gemms`` has the same methods in float8; the ring code calls only these.
    ``role`` is "input", "weight" or "grad_output".
    """

    float8 = False

    def cast(self, t: Tensor, role: str) -> Tensor:
        return t

    def to_wire(self, t: Tensor) -> Tensor:
        return t

    def from_wire(self, wire: Tensor, like: Tensor) -> Tensor:
        return wire

    def seq_chunk(self, t: Tensor, sl: slice) -> Tensor:
        return t[:, sl]

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)

    def grad_input(self, grad_y: Tensor, weight: Tensor) -> Tensor:
        return torch.matmul(grad_y, weight)

    def add_grad_weight(self, grad_w: Tensor, grad_y: Tensor, x: Tensor) -> None:
        grad_w.addmm_(_rows(grad_y).t(), _rows(x))

    def shared_linear(self, x_full: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x_full, weight)

    def output(self, y: Tensor) -> Tensor:
        return y


def _gemms_for(module: nn.Module, mesh: DeviceMesh, style: str) -> _Gemms:
    """Float8 GEMMs for a torchao ``Float8Linear`` (raises on a recipe the ring cannot run), else plain."""
    # Read from sys.modules, not imported: a module can only be a Float8Linear once torchao is loaded,
    # and importing torchao costs seconds.
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    if float8_linear is None or not isinstance(module, float8_linear.Float8Linear):
        return _Gemms()
    from torchtitan.distributed.tensor_parallel.async_tp_float8 import Float8Gemms, check_ring_float8

    check_ring_float8(module, style)
    return Float8Gemms(module, mesh)  # type: ignore[return-value]


class _AllGatherMatmul(torch.autograd.Function):
    """(x_local, W) -> (x_full @ W^T, x_full); backward is a ring matmul + reduce-scatter."""

    @staticmethod
    def forward(ctx, x_local: Tensor, weight: Tensor, ring: Ring, gemms: _Gemms) -> tuple[Tensor, Tensor]:
        # x_local (bs, seq/tp, in), weight (out/tp, in)
        x_local, weight = gemms.cast(x_local, "input"), gemms.cast(weight, "weight")
        y_chunks: list[Tensor | None] = [None] * ring.size

        def matmul(owner: int, chunk: Tensor) -> None:
            y_chunks[owner] = gemms.linear(gemms.from_wire(chunk, x_local), weight)  # (bs, seq/tp, out/tp)

        wire = torch.cat(ring_all_gather(ring, gemms.to_wire(x_local), matmul), dim=_SEQ_DIM)
        x_full = gemms.from_wire(wire, x_local)  # (bs, seq, in)
        ctx.save_for_backward(x_full, weight)
        ctx.ring, ctx.gemms = ring, gemms
        # None grads mean "this output was unused": skip its term instead of adding zeros.
        ctx.set_materialize_grads(False)
        return torch.cat(y_chunks, dim=_SEQ_DIM), x_full  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx, grad_y: Tensor | None, grad_gathered: Tensor | None):
        x_full, weight = ctx.saved_tensors
        if grad_y is None and grad_gathered is None:
            return None, None, None, None
        ring, gemms = ctx.ring, ctx.gemms
        chunk_len = x_full.shape[_SEQ_DIM] // ring.size
        grad_w = _zeros_like(weight) if grad_y is not None and ctx.needs_input_grad[1] else None
        grad_y = None if grad_y is None else gemms.cast(grad_y, "grad_output")

        def partial_grad(dest: int) -> Tensor:
            # grad of x_full's chunk ``dest``: grad_y @ W (this rank's columns) + the sharers' grads
            sl = _seq_slice(dest, chunk_len)
            if grad_y is None:
                return grad_gathered[:, sl].clone(memory_format=torch.contiguous_format)
            gy = gemms.seq_chunk(grad_y, sl)  # (bs, seq/tp, out/tp)
            if grad_w is not None:
                gemms.add_grad_weight(grad_w, gy, gemms.seq_chunk(x_full, sl))
            total = gemms.grad_input(gy, weight)  # (bs, seq/tp, in), fresh
            return total if grad_gathered is None else total.add_(grad_gathered[:, sl])

        if not ctx.needs_input_grad[0]:  # nothing to reduce-scatter; W's grad in one matmul
            if grad_w is not None:
                gemms.add_grad_weight(grad_w, grad_y, x_full)
            return None, grad_w, None, None
        return ring_reduce_scatter(ring, partial_grad), grad_w, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    """(x, W) -> reduce_scatter_seq(x @ W^T); backward is a ring all-gather + matmul."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, ring: Ring, gemms: _Gemms) -> Tensor:
        # x (bs, seq, in/tp), weight (out, in/tp)
        x, weight = gemms.cast(x, "input"), gemms.cast(weight, "weight")
        chunk_len = x.shape[_SEQ_DIM] // ring.size

        def partial_out(dest: int) -> Tensor:
            return gemms.linear(gemms.seq_chunk(x, _seq_slice(dest, chunk_len)), weight).contiguous()

        ctx.save_for_backward(x, weight)
        ctx.ring, ctx.gemms = ring, gemms
        return ring_reduce_scatter(ring, partial_out)  # (bs, seq/tp, out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        ring, gemms = ctx.ring, ctx.gemms
        chunk_len = x.shape[_SEQ_DIM] // ring.size
        grad_x_chunks: list[Tensor | None] = [None] * ring.size
        grad_w = _zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_out = gemms.cast(grad_out, "grad_output")

        def matmul(owner: int, wire: Tensor) -> None:  # the grad (bs, seq/tp, out) of chunk ``owner``
            g = gemms.from_wire(wire, grad_out)
            if ctx.needs_input_grad[0]:
                grad_x_chunks[owner] = gemms.grad_input(g, weight)  # (bs, seq/tp, in/tp)
            if grad_w is not None:
                gemms.add_grad_weight(grad_w, g, gemms.seq_chunk(x, _seq_slice(owner, chunk_len)))

        ring_all_gather(ring, gemms.to_wire(grad_out), matmul)
        grad_x = torch.cat(grad_x_chunks, dim=_SEQ_DIM) if ctx.needs_input_grad[0] else None  # type: ignore[arg-type]
        return grad_x, grad_w, None, None


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward all-reduces the grad over the group.

    The replicated bias of a row-parallel linear is added to this rank's sequence shard only, so
    each rank's local grad is a partial sum; all-reducing it leaves a full (Replicate) grad, the
    placement sync RowwiseParallel gives the bias.
    """

    @staticmethod
    def forward(ctx, t: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _autocast_off(*tensors: Tensor) -> tuple[contextlib.AbstractContextManager, tuple[Tensor, ...]]:
    """Cast to the autocast dtype as F.linear would, and a context that turns autocast off.

    Inside the ring Functions forward and backward then see one dtype (backward runs without
    autocast), and the chunks travel in the compute dtype, as autocast's gathers would.
    """
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return contextlib.nullcontext(), tensors
    dtype = torch.get_autocast_dtype(device)
    return torch.autocast(device, enabled=False), tuple(t.to(dtype) for t in tensors)


def _check_target(module: nn.Module, mesh: DeviceMesh, style: str) -> None:
    if not isinstance(module, nn.Linear):
        raise NotImplementedError(f"{style} supports nn.Linear only, got {type(module).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{style} needs the 1-D tp mesh, got a {mesh.ndim}-D mesh; pass mesh['tp']")


def _check_seq(seq_len: int, ring: Ring, style: str) -> None:
    if seq_len % ring.size != 0:
        raise ValueError(
            f"{style}: seq_len ({seq_len}) must be divisible by the tensor parallel degree "
            f"({ring.size}); pad the sequence or pick a tp degree that divides it"
        )


def _shard_params(module: nn.Module, mesh: DeviceMesh, placement_of: dict[str, Placement], src: int | None) -> None:
    # DTensor parameters, exactly as torch's Colwise/RowwiseParallel, so FSDP and the optimizer
    # see the same sharded parameters whichever TP flavour is used.
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placement_of[name]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


class AsyncColwiseParallel(ParallelStyle):
    """Column-parallel ``nn.Linear`` fed the sequence-sharded activation; ring all-gather + matmul.

    Input: a ``Shard(1)`` DTensor on the tp mesh (a ``SequenceParallel`` norm's output) or its local
    shard ``(bs, seq/tp, in)``. Output: the local ``(bs, seq, out/tp)`` tensor. Weight and bias
    become ``Shard(0)`` DTensors. Share one instance among the linears that read the same input
    (wq/wk/wv, w1/w3) so the input is gathered once forward and reduce-scattered once backward.
    """

    def __init__(self) -> None:
        super().__init__()
        # input tensor object -> (its (version, grad mode), its gathered (bs, seq, in) version);
        # entries die with the input.
        # Keyed by identity: a plain WeakKeyDictionary would compare tensors with ``==``.
        self._gathered: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_target(module, device_mesh, type(self).__name__)
        gemms = _gemms_for(module, device_mesh, type(self).__name__)
        _shard_params(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)
        ring = Ring(device_mesh.get_group())
        module.forward = partial(self._forward, module, ring, gemms)  # type: ignore[method-assign]
        return module

    def _forward(self, module: nn.Linear, ring: Ring, gemms: _Gemms, x: Tensor) -> Tensor:
        weight = module.weight.to_local()  # (out/tp, in); its grad lands on the Shard(0) DTensor
        # A cached gather is valid only for the same input contents, grad mode and precision (a
        # float8 gather is shared by float8 linears only; a mixed group gathers once per switch).
        stamp = (x._version, torch.is_grad_enabled(), gemms.float8)
        cached = self._gathered.get(x)
        if cached is None or cached[0] != stamp:
            no_autocast, (x_local, weight) = _autocast_off(self._local_shard(x, ring), weight)
            with no_autocast:
                y, x_full = _AllGatherMatmul.apply(x_local, weight, ring, gemms)
            self._gathered[x] = (stamp, x_full)
        else:
            x_full = cached[1]
            y = gemms.shared_linear(x_full, weight)  # a sharer: its grad w.r.t. x_full joins the one ring
        if module.bias is not None:
            y = y + module.bias.to_local().to(y.dtype)
        return gemms.output(y)  # (bs, seq, out/tp)

    def _local_shard(self, x: Tensor, ring: Ring) -> Tensor:
        if isinstance(x, DTensor):
            if tuple(x.placements) != (Shard(_SEQ_DIM),):
                raise ValueError(
                    f"{type(self).__name__} expects the sequence-sharded activation (Shard(1)), got "
                    f"{x.placements}; drop the PrepareModuleInput that gathers it"
                )
            _check_seq(x.shape[_SEQ_DIM], ring, type(self).__name__)
            return x.to_local()
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AsyncRowwiseParallel(ParallelStyle):
    """Row-parallel ``nn.Linear`` whose output is reduce-scattered over the sequence; ring matmul + RS.

    Input: the local full-sequence ``(bs, seq, in/tp)`` tensor (or a DTensor sharded on its last
    dim). Output: the local sequence shard ``(bs, seq/tp, out)``, as
    ``RowwiseParallel(output_layouts=Shard(1))`` returns it. Weight ``Shard(1)``, bias
    ``Replicate()`` and added once, after the reduce-scatter.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_target(module, device_mesh, type(self).__name__)
        gemms = _gemms_for(module, device_mesh, type(self).__name__)
        _shard_params(module, device_mesh, {"weight": Shard(1), "bias": Replicate()}, self.src_data_rank)
        ring = Ring(device_mesh.get_group())
        module.forward = partial(self._forward, module, ring, gemms)  # type: ignore[method-assign]
        return module

    def _forward(self, module: nn.Linear, ring: Ring, gemms: _Gemms, x: Tensor) -> Tensor:
        if isinstance(x, DTensor):
            if tuple(x.placements) not in ((Shard(x.ndim - 1),), (Shard(-1),)):
                raise ValueError(f"{type(self).__name__} expects a last-dim-sharded input, got {x.placements}")
            x = x.to_local()
        _check_seq(x.shape[_SEQ_DIM], ring, type(self).__name__)
        no_autocast, (x, weight) = _autocast_off(x, module.weight.to_local())
        with no_autocast:
            out = _MatmulReduceScatter.apply(x, weight, ring, gemms)  # (bs, seq/tp, out)
        if module.bias is not None:
            out = out + _SumGradOverRanks.apply(module.bias.to_local(), ring.group).to(out.dtype)
        return gemms.output(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
