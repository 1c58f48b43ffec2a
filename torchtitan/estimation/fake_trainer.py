"""The trainer's builders pointed at fake inputs (no tokenizer file, data, metrics or output), and
the fake-mode adaptations of torch internals.

Everything that decides memory (model build, parallelisms, optimizer, lr scheduler, the training
step with its accumulation, loss parallel, chunked loss and pipeline schedule) is the unchanged
``Trainer`` code, assembled through its public ``Builders`` seam (engine/builders.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import unittest.mock
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchtitan.components.run_control import Verdict
from torchtitan.datasets.tokenizer import build_tokenizer, find_tokenizer_file
from torchtitan.distributed.backend.c10d_compat import ALL_GATHER, REDUCE_SCATTER
from torchtitan.engine.builders import Builders
from torchtitan.spec import flavor_args


def _outside_fake_mode(fn):
    def wrapped(*args, **kwargs):
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def fake_mode_patches() -> Iterator[None]:
    """Fake-mode adaptations of the build path and the step that change no shape, dtype or
    placement (each explained where it is patched; docs/estimation.md has the table).

    ``nn.init.trunc_normal_`` fills with ``normal_``: torch 2.13's resamples until no value is out
    of range (``pending.any()``), which a fake tensor cannot answer. Fake tensors hold no values,
    so only the call's memory matters, and both fill the given tensor in place.
    """

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        return tensor.normal_(mean, std)

    from torch.distributed.device_mesh import DeviceMesh

    # (the package's ``replicate`` attribute is the function, which shadows the module of that name)
    replicate_module = importlib.import_module("torch.distributed._composable.replicate")

    def ddp_without_reducer(module, *args, **kwargs):
        # DDP's C++ reducer reads parameter data (shape checks, bucket views), which fake tensors
        # lack. Without it the step holds the same parameters, gradients and activations (the
        # all-reduce is in place); its gradient buckets are added by the estimate (ddp_bucket_bytes).
        return module

    from torch.distributed.tensor import _sharding_prop

    with (
        unittest.mock.patch.object(replicate_module, "replicate", ddp_without_reducer),
        # DTensor derives output metadata by running ops on global-shape fake tensors. In a real run
        # that happens in a FakeTensorMode of its own, which torch's trackers skip; here it would
        # reuse ours, and the trackers would count those global-shape tensors (seen with loss
        # parallel's backward: one logits-sized temporary too many at the peak).
        unittest.mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args, **kwargs: None),
        unittest.mock.patch.object(torch.nn.init, "trunc_normal_", trunc_normal_),
        # A mesh's rank map and coordinates are small CPU bookkeeping tensors, read with nonzero();
        # FSDP over TP builds sub-meshes inside fake mode. They hold no device memory.
        unittest.mock.patch.object(DeviceMesh, "__init__", _outside_fake_mode(DeviceMesh.__init__)),
    ):
        yield


class FlavorVocabTokenizer:
    """Stands in for a tokenizer file that is not on this machine: only its vocabulary size matters.

    ``eos_id`` (the trainer reads it for block_causal document boundaries) is the last id: the tokens
    are random and, under fake tensors, the documents cannot be read anyway (attention assumes one
    per row, which takes the same memory; torchtitan/models/common/attention.py).
    """

    def __init__(self, n_words: int):
        self.n_words = n_words
        self.eos_id = n_words - 1


def resolve_vocab(config) -> tuple[int, str]:
    """(vocabulary size, where it came from): the tokenizer file if present, else the flavor's."""
    path = config.model.tokenizer_path
    if find_tokenizer_file(path) is not None:
        return build_tokenizer(path).n_words, f"tokenizer {path}"
    n = flavor_args(config.model).vocab_size
    return n, f"flavor {config.model.flavor} vocabulary (tokenizer file {path} not found)"


class _RandomTokens:
    """Endless (inputs, labels) batches of the trainer's shape, created when drawn (so fake under fake mode)."""

    def __init__(self, batch_size: int, seq_len: int, vocab: int):
        self.shape, self.vocab = (batch_size, seq_len), vocab

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.vocab, (self.shape[0], self.shape[1] + 1))
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _random_batches(training, tokenizer, args, tokenizer_path: str | None):
    """Random token batches; an image family on fine-tuning data: image batches (estimation/images.py)."""
    if training.dataset_format != "text" and getattr(args, "vision", None) is not None:
        from torchtitan.estimation.images import RandomImageBatches, image_folder

        return RandomImageBatches(
            training.batch_size, training.seq_len, tokenizer.n_words, args, image_folder(tokenizer_path)
        )
    return _RandomTokens(training.batch_size, training.seq_len, tokenizer.n_words)


class _NoCheckpoint:
    """Checkpoint saving is outside the training step; the estimate starts from step 0."""

    def load(self) -> int:
        return 0

    def close(self) -> None:
        pass


class _NoGuard:
    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
        return Verdict(skip=False, stop=False)


class _NoMetrics:
    def close(self) -> None:
        pass


def estimation_builders(vocab: int, *, n_layers: int | None = None, tokenizer_path: str | None = None) -> Builders:
    """The run's builders for an estimate: no tokenizer file, data, metrics, checkpoint or output; the
    features' seams from the registry's estimator builders (a feature it does not model is refused).

    ``n_layers``: build the flavor with this many layers (the depth extrapolation's runs).
    The family builds its args for fake tensors (``ModelSpec.fake_tensor_args``: MoE routing assumed
    balanced, since real routing is data-dependent); the accuracy tests' real runs use the same
    builders, so both sides route alike. An image family on fine-tuning data draws image batches
    (estimation/images.py: the most images a window holds, sized by the processor settings beside ``tokenizer_path``).
    """
    defaults = Builders()

    def model_args(config, spec, vocab_size, *, device_type=None):
        args = defaults.model_args(config, spec, vocab_size, device_type=device_type)
        if n_layers is not None:
            args = dataclasses.replace(args, n_layers=n_layers)
        return spec.fake_tensor_args(args) if spec.fake_tensor_args is not None else args

    return Builders(
        # DeviceMesh reads rank coordinates with .item(), which fake tensors cannot answer.
        mesh=_outside_fake_mode(defaults.mesh),
        tokenizer=lambda model: FlavorVocabTokenizer(vocab),
        model_args=model_args,
        # Plain meta tensors, as in a real run (to_empty then materialises them, here as fake tensors);
        # a meta model built under fake mode would hold fake-meta tensors that cannot be materialised.
        meta_model=_outside_fake_mode(defaults.meta_model),
        data_loader=lambda training, tokenizer, shard, args=None: _random_batches(
            training, tokenizer, args, tokenizer_path
        ),
        metrics=lambda core, gradients, *, start_step: _NoMetrics(),
        checkpointer=lambda core, share, modules: _NoCheckpoint(),
        # The guard reads the step's flags on the host, which fake tensors cannot answer; a fake step
        # is never non-finite and never asked to stop.
        guard=lambda core, metrics, signals: _NoGuard(),
        estimate=True,
    )


@contextlib.contextmanager
def pipeline_patches(
    hidden_shape: tuple[int, ...], hidden_dtype: torch.dtype, boundary_tensors: int = 1
) -> Iterator[None]:
    """Run torch's pipeline schedules for one simulated rank under the fake process group.

    A schedule's first step votes (a P2P all-stage agreement read with ``.item()``) and then infers
    each stage's input/output metadata from its neighbours over P2P object messages; the fake
    group delivers nothing. Here every stage infers dynamically as in a real run, and what a
    neighbour would have sent is supplied in place: the hidden state every stage boundary carries, (micro-batch,
    local seqlen, *the model class's ``hidden_dims``) in the stream's dtype (``boundary_tensors`` of them: MTP's
    embedded tokens ahead beside it), and for backward the gradient of this stage's own output. The data P2P of the
    actual steps runs through the fake group as is (receive buffers allocated as in a real run; ``p2p_works_hold_tensors``).
    """
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
        extract_tensor_meta,
    )

    hidden = extract_tensor_meta(torch.empty(hidden_shape, dtype=hidden_dtype, device="meta", requires_grad=True))

    def warmup_p2p(self, stages, has_backward, p2p_done):
        for s in stages:
            s._inference_mode = InferenceMode.DYNAMIC

    def recv_meta(self, src_stage):
        if src_stage < self.stage_index:
            return _StageForwardMeta(forward_metas=(hidden,) * boundary_tensors)
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    with (
        unittest.mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", warmup_p2p),
        unittest.mock.patch.object(stage.PipelineStage, "_recv_meta", recv_meta),
        unittest.mock.patch.object(stage.PipelineStage, "_send_meta", lambda self, meta, dst_stage: None),
    ):
        yield


class _HoldingWork:
    """A fake P2P work that keeps its tensor alive for as long as the work itself lives."""

    def __init__(self, work, tensor: torch.Tensor):
        self._work, self._tensor = work, tensor

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def p2p_works_hold_tensors() -> Iterator[None]:
    """A real P2P work (gloo's send/recv work; NCCL's, which stashes its tensors for the caching
    allocator) references its tensor until the work object is released. The multi-stage pipeline
    schedules keep every send's work until the end of the step (``_PipelineScheduleRuntime``:
    ``send_ops``, waited after the last action), so a stage's input gradients stay alive until
    then although nothing else reads them (measured on gloo: 0.125 MiB per micro-batch on the
    Interleaved1F1B debug row, 0.875 MiB at pp rank 1's peak); the ring attention's last K/V
    block lives as long as its send's work. The fake group's works hold nothing; here they hold
    their tensor.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def holding(real):
        return lambda tensor, *args, **kwargs: _HoldingWork(real(tensor, *args, **kwargs), tensor)

    patched = {"isend": holding(c10d.isend), "irecv": holding(c10d.irecv)}
    # batch_isend_irecv checks each op against the module's isend/irecv: patch both names.
    with contextlib.ExitStack() as stack:
        for module in (dist, c10d):
            for name, fn in patched.items():
                stack.enter_context(unittest.mock.patch.object(module, name, fn))
        yield


def ddp_bucket_bytes(model_parts) -> int:
    """DDP's gradient buckets: one flat copy of every gradient (gradient_as_bucket_view = False),
    allocated when DDP is built and kept for the whole run."""
    return sum(p.numel() * p.element_size() for part in model_parts for p in part.parameters() if p.requires_grad)


class _ShapeOnlyGroupedMM(torch.autograd.Function):
    """``torch._grouped_mm``'s allocations for fp32 inputs, whose fake (meta) kernel accepts only bf16.

    Forward: the (T, N) output, saving both inputs as the real op does; backward: grads shaped like
    the inputs (the real op computes them with two more grouped matmuls of those shapes).
    """

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])  # (T, N)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.new_empty(a.shape), grad.new_empty(b.shape), None


def _grouped_mm(a, b, offs=None, **kwargs):
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return _REAL_GROUPED_MM(a, b, offs=offs, **kwargs)
    return _ShapeOnlyGroupedMM.apply(a, b, offs)


_REAL_GROUPED_MM = torch._grouped_mm


@contextlib.contextmanager
def grouped_mm_patches() -> Iterator[None]:
    """``torch._grouped_mm`` (the MoE experts) on fake fp32 inputs, whose meta kernel takes only bf16."""
    with unittest.mock.patch.object(torch, "_grouped_mm", _grouped_mm):
        yield


@contextlib.contextmanager
def gloo_frees_in_order(timeout_s: float = 120.0) -> Iterator[None]:
    """The real (tracked) run only, on gloo: FSDP's all-gather and reduce-scatter return once
    gloo's worker thread has let go of the finished work.

    gloo signals completion before its worker thread drops the work, which holds the collective's
    tensors (FSDP's all-gather output, gloo's own reduce-scatter buffer). Whether the main thread's
    next allocation sees them freed was a race: the tracked peak of the same step varied by one
    all-gather buffer between runs (the tiny family's FSDP2 step: 8,690,728 or 9,280,552 bytes).
    Here each call waits, then yields until the output's storage has no reference beyond those it
    had before the call, so buffers are freed where the step drops them, as stream-ordered NCCL
    frees them. Training never runs under this: it makes the measurement repeatable.
    """
    import time

    import torch.distributed as dist

    def released_on_return(real):
        def call(output, input, *args, async_op: bool = False, **kwargs):
            storage = output.untyped_storage()._cdata
            before = torch._C._storage_Use_Count(storage)
            work = real(output, input, *args, async_op=True, **kwargs)
            work.wait()
            del work
            deadline = time.monotonic() + timeout_s
            while torch._C._storage_Use_Count(storage) > before:
                if time.monotonic() > deadline:  # measuring on would race again: say so instead
                    raise RuntimeError(
                        f"gloo's worker thread still holds a finished {real.__name__} after {timeout_s:.0f} s: "
                        "the tracked peak would not be repeatable (an overloaded machine?)"
                    )
                time.sleep(0)  # the worker thread still holds the finished work
            return None  # FSDP waits only on a returned Work: this one is done

        return call

    with (
        unittest.mock.patch.object(dist, ALL_GATHER, released_on_return(getattr(dist, ALL_GATHER))),
        unittest.mock.patch.object(dist, REDUCE_SCATTER, released_on_return(getattr(dist, REDUCE_SCATTER))),
    ):
        yield


@contextlib.contextmanager
def gloo_patches() -> Iterator[None]:
    """What gloo's collectives allocate that the fake process group does not (CPU runs only).

    gloo's ``reduce_scatter_single`` (``c10d_compat.REDUCE_SCATTER``: FSDP's gradient reduce-scatter, context parallel's dK/dV)
    reduces into a buffer the size of the whole input and then copies this rank's chunk out, so
    an input-sized temporary is live until the call returns (measured with a dispatch spy on a
    real gloo group: ``split`` of a new input-sized storage, then ``copy_`` into the output). The
    fake group allocates nothing; this allocates and drops the same buffer after its call, where
    the tracker sees it on the real run. NCCL reduce-scatters in place: no such buffer on GPU.
    """
    import torch.distributed as dist

    real = getattr(dist, REDUCE_SCATTER)

    def reduce_scatter_single(output, input, *args, **kwargs):
        work = real(output, input, *args, **kwargs)
        torch.empty_like(input).split(output.numel())
        return work

    with unittest.mock.patch.object(dist, REDUCE_SCATTER, reduce_scatter_single):
        yield


@contextlib.contextmanager
def compile_patches() -> Iterator[None]:
    """A compiled block (activation_checkpoint.mode = 'memory_budget') as its partitioned graphs, run op by op.

    Inductor's kernels cannot run on fake tensors, and the buffers its generated code allocates bypass the dispatcher,
    where the trackers look. Inductor's entry (``compile_fx``, which torch's "inductor" backend and the budget's
    backend call at each compile) becomes AOTAutograd with inductor's own decompositions and partition (its
    joint-graph passes, then the min-cut partitioner), under the same memory budget, so each block's forward saves
    the activations inductor's would, and the graphs' ops run one by one, each seen by the tracker. Inductor's fused
    kernels hold fewer temporaries inside a graph than these ops do; what lives between forward and backward is the
    same. Every compile of the estimate starts from an empty dynamo cache: each build's blocks are new, and a cache
    kept across builds (the depth reduction's two, the planner's many) would hit dynamo's recompile limit and run
    the later ones eagerly.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    def partitioned_graphs(gm, example_inputs, **kwargs):
        # inductor's own AOTAutograd settings (compile_fx._compile_fx_main): its decompositions, and its partition
        # (its joint-graph passes, then the min-cut partitioner); only the graphs' compilers differ
        with torch._functorch.config.patch(unlift_effect_tokens=True):
            return aot_autograd(
                fw_compiler=boxed_nop,
                bw_compiler=boxed_nop,
                decompositions=select_decomp_table(),
                partition_fn=compile_fx.partition_fn,
                keep_inference_input_mutations=True,
            )(gm, example_inputs)

    torch._dynamo.reset()
    try:
        with unittest.mock.patch.object(compile_fx, "compile_fx", partitioned_graphs):
            yield
    finally:
        torch._dynamo.reset()
