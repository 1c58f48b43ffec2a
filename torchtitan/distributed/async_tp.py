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

Instrumentation: ``with record_events() as events:`` collects ``(kind, step)`` tuples in program
order: ``("all_gather", tp)`` / ``("reduce_scatter", tp)`` when a ring starts, then per step
``("comm_issued", s)``, ``("mm_start", s)``, ``("mm_end", s)``, ``("comm_waited", s)``, where a
comm is labelled with the step whose matmul it overlaps. Off by default; then each record is one
``None`` check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["AsyncColwiseParallel", "AsyncRowwiseParallel", "record_events"]

_SEQ_DIM = 1
_events: list[tuple[str, int]] | None = None  # the active recorder's list; None = recording off


@contextlib.contextmanager
def record_events() -> Iterator[list[tuple[str, int]]]:
    """Record the ring schedule's ``(kind, step)`` events of this process while the block runs."""
    global _events
    previous, events = _events, []
    _events = events
    try:
        yield events
    finally:
        _events = previous


def _record(kind: str, step: int) -> None:
    if _events is not None:
        _events.append((kind, step))


class _Ring:
    """This rank's neighbours in the TP group, ordered by group rank."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2POp takes global ranks; the TP group is usually a strided subset of the world.
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, send: Tensor, recv: Tensor, step: int) -> tuple[list, Tensor]:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one."""
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, self.next, self.group),
                dist.P2POp(dist.irecv, recv, self.prev, self.group),
            ]
        )
        _record("comm_issued", step)
        return works, send  # the caller keeps ``send`` alive until the wait

    @staticmethod
    def wait(pending: tuple[list, Tensor], step: int) -> None:
        for work in pending[0]:
            work.wait()
        _record("comm_waited", step)


def _ring_all_gather(ring: _Ring, local: Tensor, compute: Callable[[int, Tensor], None]) -> list[Tensor]:
    """All-gather ``local`` chunks; ``compute(c, chunk_c)`` runs while the next chunk is in flight.

    Returns the chunks indexed by the group rank that owns them.
    """
    _record("all_gather", ring.size)
    chunks: list[Tensor | None] = [None] * ring.size
    current, owner = local.contiguous(), ring.rank
    for step in range(ring.size):
        chunks[owner] = current
        pending, incoming = None, None
        if step < ring.size - 1:
            incoming = torch.empty_like(current)
            pending = ring.shift(current, incoming, step)
        _record("mm_start", step)
        compute(owner, current)
        _record("mm_end", step)
        if pending is not None:
            ring.wait(pending, step)
            current, owner = incoming, (owner - 1) % ring.size
    return chunks  # type: ignore[return-value]


def _ring_reduce_scatter(ring: _Ring, partial_for: Callable[[int], Tensor]) -> Tensor:
    """Sum over ranks of ``partial_for(c)`` for ``c`` = this rank's chunk.

    ``partial_for`` must return a fresh contiguous tensor (it is summed into in place and sent).
    The partial of the next destination is computed while the running sum of the previous one
    moves one hop along the ring.
    """
    _record("reduce_scatter", ring.size)
    pending, incoming = None, None
    for step in range(ring.size):
        dest = (ring.rank - step - 1) % ring.size  # the last step (dest == rank) keeps the sum
        _record("mm_start", step)
        total = partial_for(dest)
        _record("mm_end", step)
        if pending is not None:
            ring.wait(pending, step)
            total.add_(incoming)
        if step == ring.size - 1:
            return total
        incoming = torch.empty_like(total)
        pending = ring.shift(total, incoming, step + 1)
    raise AssertionError("unreachable: the ring has at least one step")


def _seq_slice(chunk: int, chunk_len: int) -> slice:
    return slice(chunk * chunk_len, (chunk + 1) * chunk_len)


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])  # (bs * seq, features)


class _AllGatherMatmul(torch.autograd.Function):
    """(x_local, W) -> (x_full @ W^T, x_full); backward is a ring matmul + reduce-scatter."""

    @staticmethod
    def forward(ctx, x_local: Tensor, weight: Tensor, ring: _Ring) -> tuple[Tensor, Tensor]:
        # x_local (bs, seq/tp, in), weight (out/tp, in)
        y_chunks: list[Tensor | None] = [None] * ring.size

        def matmul(owner: int, chunk: Tensor) -> None:
            y_chunks[owner] = F.linear(chunk, weight)  # (bs, seq/tp, out/tp)

        x_full = torch.cat(_ring_all_gather(ring, x_local, matmul), dim=_SEQ_DIM)  # (bs, seq, in)
        ctx.save_for_backward(x_full, weight)
        ctx.ring = ring
        # None grads mean "this output was unused": skip its term instead of adding zeros.
        ctx.set_materialize_grads(False)
        return torch.cat(y_chunks, dim=_SEQ_DIM), x_full  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx, grad_y: Tensor | None, grad_gathered: Tensor | None):
        x_full, weight = ctx.saved_tensors
        if grad_y is None and grad_gathered is None:
            return None, None, None
        ring: _Ring = ctx.ring
        chunk_len = x_full.shape[_SEQ_DIM] // ring.size
        grad_w = torch.zeros_like(weight) if grad_y is not None and ctx.needs_input_grad[1] else None

        def partial_grad(dest: int) -> Tensor:
            # grad of x_full's chunk ``dest``: grad_y @ W (this rank's columns) + the sharers' grads
            sl = _seq_slice(dest, chunk_len)
            if grad_y is None:
                return grad_gathered[:, sl].clone(memory_format=torch.contiguous_format)
            gy = grad_y[:, sl]  # (bs, seq/tp, out/tp)
            if grad_w is not None:
                grad_w.addmm_(_rows(gy).t(), _rows(x_full[:, sl]))
            total = torch.matmul(gy, weight)  # (bs, seq/tp, in), fresh
            return total if grad_gathered is None else total.add_(grad_gathered[:, sl])

        if not ctx.needs_input_grad[0]:  # nothing to reduce-scatter; W's grad in one matmul
            if grad_w is not None:
                grad_w.addmm_(_rows(grad_y).t(), _rows(x_full))
            return None, grad_w, None
        return _ring_reduce_scatter(ring, partial_grad), grad_w, None


class _MatmulReduceScatter(torch.autograd.Function):
    """(x, W) -> reduce_scatter_seq(x @ W^T); backward is a ring all-gather + matmul."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, ring: _Ring) -> Tensor:
        # x (bs, seq, in/tp), weight (out, in/tp)
        chunk_len = x.shape[_SEQ_DIM] // ring.size

        def partial_out(dest: int) -> Tensor:
            return F.linear(x[:, _seq_slice(dest, chunk_len)], weight).contiguous()  # (bs, seq/tp, out)

        ctx.save_for_backward(x, weight)
        ctx.ring = ring
        return _ring_reduce_scatter(ring, partial_out)  # (bs, seq/tp, out)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        ring: _Ring = ctx.ring
        chunk_len = x.shape[_SEQ_DIM] // ring.size
        grad_x_chunks: list[Tensor | None] = [None] * ring.size
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None

        def matmul(owner: int, g: Tensor) -> None:  # g (bs, seq/tp, out) of chunk ``owner``
            if ctx.needs_input_grad[0]:
                grad_x_chunks[owner] = torch.matmul(g, weight)  # (bs, seq/tp, in/tp)
            if grad_w is not None:
                grad_w.addmm_(_rows(g).t(), _rows(x[:, _seq_slice(owner, chunk_len)]))

        _ring_all_gather(ring, grad_out, matmul)
        grad_x = torch.cat(grad_x_chunks, dim=_SEQ_DIM) if ctx.needs_input_grad[0] else None  # type: ignore[arg-type]
        return grad_x, grad_w, None


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


def _check_seq(seq_len: int, ring: _Ring, style: str) -> None:
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
        _shard_params(module, device_mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank)
        ring = _Ring(device_mesh.get_group())
        module.forward = partial(self._forward, module, ring)  # type: ignore[method-assign]
        return module

    def _forward(self, module: nn.Linear, ring: _Ring, x: Tensor) -> Tensor:
        weight = module.weight.to_local()  # (out/tp, in); its grad lands on the Shard(0) DTensor
        # A cached gather is valid only for the same input contents and grad mode.
        stamp = (x._version, torch.is_grad_enabled())
        cached = self._gathered.get(x)
        if cached is None or cached[0] != stamp:
            no_autocast, (x_local, weight) = _autocast_off(self._local_shard(x, ring), weight)
            with no_autocast:
                y, x_full = _AllGatherMatmul.apply(x_local, weight, ring)
            self._gathered[x] = (stamp, x_full)
        else:
            x_full = cached[1]
            y = F.linear(x_full, weight)  # a sharer: its grad w.r.t. x_full joins the one ring
        if module.bias is not None:
            y = y + module.bias.to_local().to(y.dtype)
        return y  # (bs, seq, out/tp)

    def _local_shard(self, x: Tensor, ring: _Ring) -> Tensor:
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
        _shard_params(module, device_mesh, {"weight": Shard(1), "bias": Replicate()}, self.src_data_rank)
        ring = _Ring(device_mesh.get_group())
        module.forward = partial(self._forward, module, ring)  # type: ignore[method-assign]
        return module

    def _forward(self, module: nn.Linear, ring: _Ring, x: Tensor) -> Tensor:
        if isinstance(x, DTensor):
            if tuple(x.placements) not in ((Shard(x.ndim - 1),), (Shard(-1),)):
                raise ValueError(f"{type(self).__name__} expects a last-dim-sharded input, got {x.placements}")
            x = x.to_local()
        _check_seq(x.shape[_SEQ_DIM], ring, type(self).__name__)
        no_autocast, (x, weight) = _autocast_off(x, module.weight.to_local())
        with no_autocast:
            out = _MatmulReduceScatter.apply(x, weight, ring)  # (bs, seq/tp, out)
        if module.bias is None:
            return out
        return out + _SumGradOverRanks.apply(module.bias.to_local(), ring.group).to(out.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
