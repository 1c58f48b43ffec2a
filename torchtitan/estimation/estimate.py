"""Estimate one config's per-rank memory: the trainer's build and step on fake tensors, one rank per role."""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from torchtitan.build import build_model_args
from torchtitan.components.optim.param_groups import optimizer_state_by_group
from torchtitan.distributed.backend.device import ProcessFlags, get_device_info
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline.layout import resolve_stage_layout, stage_ids_for_rank
from torchtitan.dtypes import to_dtype
from torchtitan.estimation.fake_trainer import (
    compile_patches,
    ddp_bucket_bytes,
    estimation_builders,
    fake_mode_patches,
    gloo_frees_in_order,
    gloo_patches,
    grouped_mm_patches,
    p2p_works_hold_tensors,
    pipeline_patches,
    resolve_vocab,
)
from torchtitan.estimation.foreach import use_per_parameter_step
from torchtitan.estimation.images import describe, image_folder
from torchtitan.estimation.tracker import DDP_BUCKETS, StepMemory, track_steps
from torchtitan.features.registry import check_estimable_features, plan_terms
from torchtitan.models.common.ends import hidden_dims
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec
from torchtitan.train import Trainer

# The optimizer step is modeled as torch 2.13 and later run it (the tracker on real runs agrees on 2.13 and 2.15).
# On 2.11 and 2.12 the tiny family's real FSDP2 step (tests/distributed/test_model_family.py) held 7x its sharded
# parameters more at the optimizer step, which became the peak: 12% above the estimate. One model, cause not found.
OPTIMIZER_STEP_MODELED_SINCE = (2, 13)


def torch_release_warnings() -> list[str]:
    """What this estimate does not model on this torch release (one line each)."""
    if TorchVersion(torch.__version__) >= OPTIMIZER_STEP_MODELED_SINCE:
        return []
    return [
        f"torch {torch.__version__}: the optimizer step is modeled as torch 2.13 and later run it; on 2.11 and 2.12 "
        "a real FSDP2 step held up to 7x the sharded parameters more there (measured on one small model: its peak "
        "12% above this estimate), so the optimizer-step phase may be low"
    ]


# Settings the fake run cannot reproduce faithfully: (key, value that is fine, why).
_UNMODELED = (
    (
        "training.compile",
        False,
        "torch.compile under FakeTensorMode traces other graphs than the real run "
        "(fused kernels, different temporaries); estimate with compile off and expect less memory with it "
        "(activation_checkpoint.mode = 'memory_budget', which compiles, is modeled: the partitioner's saved activations)",
    ),
    (
        "training.compile_loss",
        False,
        "the compiled loss's fused kernel holds other temporaries than the fake run's eager one; estimate with it "
        "off and expect less memory with it",
    ),
    (
        "training.enable_cpu_offload",
        False,
        "FSDP CPU offload moves parameters, gradients and optimizer state to "
        "host memory; the trackers do not separate host from device memory on a CPU run",
    ),
    ("optimizer.fused", False, "the fused optimizer kernel is CUDA-only and its temporaries are not modeled"),
)


@dataclass
class RoleEstimate:
    """One distinct rank role (a pipeline stage's ranks, or every rank without PP)."""

    role: str
    rank: int
    memory: StepMemory


@dataclass
class Estimate:
    world_size: int
    layout: dict[str, int]
    vocab_source: str
    roles: list[RoleEstimate]
    seconds: float
    warnings: list[str] = field(default_factory=list)
    params: int = 0  # the whole model's parameters at full depth (meta device; buffers not counted)
    optimizer_groups: list[dict] = field(default_factory=list)
    """Per optimizer param group of the whole model: optimizer, parameters, state (components/optim/param_groups.py)."""

    @property
    def peak(self) -> int:
        return max(r.memory.peak for r in self.roles)


def check_estimable(config, world_size: int) -> None:
    """Raise NotImplementedError naming any setting the estimate cannot model."""
    for key, fine, why in _UNMODELED:
        section, _, name = key.partition(".")
        value = getattr(getattr(config, section), name)
        if key == "training.compile" and config.activation_checkpoint.mode == "memory_budget":
            continue  # the blocks' partitioned graphs run op by op (fake_trainer.compile_patches)
        if value != fine:
            raise NotImplementedError(f"estimation.py: {key} = {value!r} is not modeled: {why}; set {key} = {fine!r}")
    check_estimable_features(config)  # features outside the step (validation, evaluation): the registry says which


def role_ranks(dims: ParallelDims) -> list[tuple[str, int, int]]:
    """(role, representative global rank, pp rank) per role. pp is the outermost mesh axis, so pp
    rank k owns ranks k*W/pp ...; within a stage every rank holds the same shapes (FSDP's first
    rank holds the largest shard when a dimension does not divide evenly: the one to estimate)."""
    if dims.pp == 1:
        return [("all ranks", 0, 0)]
    per_stage = dims.world_size // dims.pp
    return [(f"pp rank {k}", k * per_stage, k) for k in range(dims.pp)]


def _family_patches(config):
    """The family's own fake-tensor adaptations (``ModelSpec.fake_tensor_context``), or none."""
    context = get_model_spec(config.model.name).fake_tensor_context
    return context() if context is not None else contextlib.nullcontext()


def estimate_rank(
    config, world_size: int, rank: int, vocab: int, *, fake: bool = True, n_layers: int | None = None
) -> StepMemory:
    """Build the trainer as global rank ``rank`` and track two training steps.

    fake=True: FakeTensorMode under a fake process group created here (and destroyed after).
    fake=False: real tensors under the process group that already exists (a torchrun launch).
    n_layers: build the flavor with this many layers (the depth extrapolation's runs).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    own_group = fake and world_size > 1
    if own_group:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    # the build sets them (training.deterministic, float8 on CPU) and an estimate's trainer is never closed
    flags = ProcessFlags.read()
    try:
        builders = estimation_builders(vocab, n_layers=n_layers, tokenizer_path=config.model.tokenizer_path)
        if not fake:  # the accuracy tests' real run: same builders (and routing assumption), real tensors
            gloo = gloo_frees_in_order() if get_device_info().backend == "gloo" else contextlib.nullcontext()
            with gloo, _compile_patches(config):
                trainer = Trainer(config, world_size=world_size, rank=rank, builders=builders)
                return track_steps(trainer)
        # allow_non_fake_inputs: the meta model (see estimation_builders) is plain meta tensors.
        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            _compile_patches(config),
            fake_mode_patches(),
            grouped_mm_patches(),
            _pipeline_patches(config, world_size, vocab),
            _backend_patches(),
            _family_patches(config),
        ):
            trainer = Trainer(config, world_size=world_size, rank=rank, builders=builders)
            foreach_temp = use_per_parameter_step(trainer.optimizer)
            # In backward each parameter steps alone in a hook (its group's foreach flag is copied
            # there): the tracker sees that step's own temporaries, there are no list-wide ones.
            memory = track_steps(
                trainer, foreach_temp=0 if trainer.core.optimizer_step.steps_in_backward else foreach_temp
            )
            for terms in plan_terms(config):  # what a feature holds that the fake step does not run
                terms.modeled_memory(memory, config, trainer.model_parts, trainer.device)
            if trainer.parallel_dims.dp_replicate_enabled and not trainer.parallel_dims.dp_shard_enabled:
                buckets = ddp_bucket_bytes(trainer.model_parts)
                memory.add_persistent(
                    DDP_BUCKETS,
                    buckets,
                    "DDP gradient buckets modeled: a flat copy of every "
                    "gradient, allocated when DDP is built (its C++ reducer cannot run on fake tensors)",
                )
            return memory
    finally:
        flags.restore()
        if own_group:
            dist.destroy_process_group()


@contextlib.contextmanager
def _backend_patches():
    """What real communication holds that the fake group does not: P2P works keep their tensors;
    gloo (the backend the trainer uses on CPU) reduce-scatters through a buffer of its own."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(p2p_works_hold_tensors())
        if get_device_info().backend == "gloo":
            stack.enter_context(gloo_patches())
        yield


def _compile_patches(config):
    """With compile (activation_checkpoint.mode = 'memory_budget'): the blocks' partitioned graphs run op by op."""
    return compile_patches() if config.training.compile else contextlib.nullcontext()


def _pipeline_patches(config, world_size: int, vocab: int):
    """Under PP: the stage-boundary tensor a neighbour stage would describe (see pipeline_patches)."""
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    if not dims.pp_enabled:
        return contextlib.nullcontext()
    t = config.training
    microbatches = config.experimental.pipeline_parallel_microbatches or dims.pp
    # The residual stream: sequence-sharded over CP, and over TP by sequence parallel; FSDP computes
    # in its param dtype, as do bf16 parameters (training.dtype); otherwise the stream stays fp32 (autocast leaves
    # the residual adds fp32).
    spec = get_model_spec(config.model.name)
    args = build_model_args(config, spec, vocab)
    hidden = hidden_dims(spec.model_cls, args)  # (dim,); V4: (hc_mult, dim)
    shape = (t.batch_size // microbatches, t.seq_len // (dims.cp * dims.tp), *hidden)
    dtype = to_dtype(t.mixed_precision_param) if dims.fsdp_enabled or t.dtype != "float32" else torch.float32
    # multi-token prediction: the embedded tokens ahead, one per depth, in the embedding's (the stream's) dtype
    return pipeline_patches(shape, dtype, boundary_tensors=1 + getattr(args, "mtp_layers", 0))


@dataclass(frozen=True)
class DepthReduction:
    """Estimate at two reduced depths and extrapolate linearly to the real one.

    Every transformer block of a model (or every period of an MoE model's dense/MoE pattern) holds
    the same parameters, gradients, optimizer state and saved activations, so each rank's peak,
    and each row of its breakdown, is affine in the number of blocks it holds once the edge
    effects (FSDP keeps the last block unsharded, prefetching reaches a few blocks ahead) are the
    same: ``REDUCED_UNITS`` blocks per stage are past them. Two fake runs of a few blocks cost the
    same whatever the real depth, which is what makes the 70B and 405B estimates, and ``--plan``,
    take seconds. ``--full_depth`` runs the real depth instead (tests/runs/estimation/test_estimation.py checks that
    both agree).
    """

    prefix: int  # leading layers kept as they are (an MoE model's first dense layers)
    unit: int  # layers per repeated unit (1; an MoE model's moe_every)
    stages: int  # pipeline stages (1 without PP)
    units: tuple[int, int] = (3, 5)  # units per stage of the two reduced runs

    def n_layers(self, units_per_stage: int) -> int:
        return self.prefix + units_per_stage * self.unit * self.stages

    def split_points(self, units_per_stage: int) -> list[str]:
        per_stage = units_per_stage * self.unit
        return [f"layers.{self.prefix + i * per_stage}" for i in range(1, self.stages)]


def plan_depth(config, args, dims: ParallelDims, full_depth: bool) -> DepthReduction | None:
    """The reduction to use, or None to run the real depth (small models; a layer prefix under PP)."""
    if full_depth:
        return None
    prefix, unit = get_model_spec(config.model.name).layer_pattern(args)  # MoE: (first dense layers, moe_every)
    if (prefix or unit > 1) and dims.pp_enabled:
        return None  # stages would mix the prefix and the periods unevenly
    if dims.pp_enabled:
        layout = _stage_layout(config, args.n_layers, dims)
        reduction, fewest = DepthReduction(prefix, unit, len(layout)), min(e - f for f, e in layout) / unit
    else:
        reduction, fewest = DepthReduction(prefix, unit, 1), (args.n_layers - prefix) / unit
    # Only when every stage is deeper than the larger reduced run: extrapolation, not interpolation
    # into the edge effects (measured: exact at 3 and 5 units, off by up to 12 % at 2 and 3).
    return reduction if fewest > reduction.units[1] else None


def _stage_layout(config, n_layers: int, dims: ParallelDims) -> list[tuple[int, int]]:
    exp = config.experimental
    return resolve_stage_layout(
        n_layers,
        dims.pp,
        exp.pipeline_parallel_schedule,
        exp.pipeline_parallel_split_points,
        exp.pipeline_parallel_schedule_csv,
    )


def _role_units(config, args, dims: ParallelDims, pp_rank: int, reduction: DepthReduction) -> float:
    """The real depth of a role in units: its stages' mean layer count under PP."""
    if not dims.pp_enabled:
        return (args.n_layers - reduction.prefix) / reduction.unit
    layout = _stage_layout(config, args.n_layers, dims)
    ids = stage_ids_for_rank(pp_rank, dims.pp, len(layout), config.experimental.pipeline_parallel_schedule)
    return sum(layout[i][1] - layout[i][0] for i in ids) / len(ids) / reduction.unit


def _reduced_config(config, reduction: DepthReduction, units_per_stage: int):
    reduced = copy.deepcopy(config)
    if reduction.stages > 1:
        reduced.experimental.pipeline_parallel_split_points = reduction.split_points(units_per_stage)
    return reduced


def estimate_role(
    config,
    world_size: int,
    rank: int,
    pp_rank: int,
    vocab: int,
    args,
    dims: ParallelDims,
    reduction: DepthReduction | None,
) -> StepMemory:
    if reduction is None:
        return estimate_rank(config, world_size, rank, vocab)
    (u1, u2), runs = reduction.units, []
    for units in (u1, u2):
        n_layers = reduction.n_layers(units)
        runs.append(
            estimate_rank(_reduced_config(config, reduction, units), world_size, rank, vocab, n_layers=n_layers)
        )
    real = _role_units(config, args, dims, pp_rank, reduction)
    note = (
        f"extrapolated linearly from {reduction.n_layers(u1)}- and {reduction.n_layers(u2)}-layer runs "
        f"to the real {args.n_layers} layers (--full_depth runs them all)"
    )
    return runs[0].extrapolate(runs[1], (real - u1) / (u2 - u1), note)


def estimate_memory(config, world_size: int, *, full_depth: bool = False, pp_ranks: str = "all") -> Estimate:
    """Validate (as the trainer does, minus file checks), then estimate every role's peak."""
    start = time.perf_counter()
    warnings = run_preflight(config, world_size, this_machine=False) + torch_release_warnings()
    check_estimable(config, world_size)
    vision = getattr(get_model_spec(config.model.name).flavor_args(config.model), "vision", None)
    if vision is not None and config.training.dataset_format != "text":  # the image batches' assumption
        warnings.append(describe(vision, config.training.seq_len, image_folder(config.model.tokenizer_path)))
    if dist.is_initialized():
        raise RuntimeError("estimate_memory creates its own fake process group; call it without one")
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    vocab, source = resolve_vocab(config)
    args = build_model_args(config, get_model_spec(config.model.name), vocab)
    reduction = plan_depth(config, args, dims, full_depth)
    roles = role_ranks(dims)
    if pp_ranks == "ends":  # the planner: first and last pipeline rank only
        roles = [r for r in roles if r[2] in (0, dims.pp - 1)]
    roles = [
        RoleEstimate(role, rank, estimate_role(config, world_size, rank, pp_rank, vocab, args, dims, reduction))
        for role, rank, pp_rank in roles
    ]
    params = count_parameters(config.model.name, args)
    groups = optimizer_state_by_group(named_shapes(config.model.name, args), config.optimizer)
    seconds = time.perf_counter() - start
    return Estimate(world_size, dims.degrees(), source, roles, seconds, warnings, params, groups)


def named_shapes(model_name: str, args: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the whole model at full depth (meta device)."""
    with torch.device("meta"):
        return [(n, tuple(p.shape)) for n, p in get_model_spec(model_name).model_cls(args).named_parameters()]


def count_parameters(model_name: str, args: Any) -> int:
    """The whole model's parameters at full depth (built on the meta device; buffers not counted)."""
    return sum(math.prod(shape) for _, shape in named_shapes(model_name, args))
