"""``estimation.py --plan``: the layouts of a world size that fit a memory budget, ranked by a throughput model.

Candidates: every (pp, dp_replicate, dp_shard, cp, tp) that multiplies to the world size and that
the trainer's own validation accepts, holding the config's *global* batch fixed (each candidate's
per-rank batch is global / dp), with TP and CP inside a node, plus pipeline micro-batches (pp or
2 x pp) and activation checkpointing (none, then selective op, then full: for one layout the first
that fits is kept, since less recomputation is always faster). Expert parallel degrees are
enumerated for MoE models. Each candidate's memory is the estimator's (fake tensors, depth
extrapolated); a lower bound from parameters, gradients and optimizer state alone discards the
hopeless ones before any fake run.

Throughput model (a ranking aid, not a prediction; see docs/estimation.md). Per optimizer step and rank:
* compute = training FLOPs / (peak FLOP/s x ``MODEL_EFFICIENCY``); the FLOPs are 6 x parameters x
  tokens plus attention (metrics.compute_num_flops_per_token), times 4/3 with full activation
  checkpointing (the forward runs twice) and ``OP_AC_RECOMPUTE`` with selective op AC;
* exposed communication = TP and CP traffic (on the critical path) / link bandwidth, plus the
  part of FSDP/HSDP/DDP traffic that the compute cannot hide (max(0, dp_time - compute));
* pipeline bubble: compute x (pp - 1) / micro-batches (1F1B/GPipe family).
* float8 (``float8.enable_float8_linear``, the memory side is the estimator's: float8 all-gather
  buffers and scales): the 6 x parameters part runs at ``FLOAT8_GEMM_SPEEDUP`` x the bf16 rate
  (the datasheets' dense float8 peak is 2x bf16 on Hopper/Ada; the casts and the high-precision
  output head keep the gain below that), and with ``enable_fsdp_float8_all_gather`` the two FSDP
  all-gathers move 1 byte per parameter.
* fault tolerance (``fault_tolerance.enable``; the world size is then one replica group's ranks, and
  ``data_parallel_replicate_degree`` must be 1): each rank's fp32 gradient shard is all-reduced across the
  ``group_size`` groups after backward, not overlapped with it (synchronous mode: every step; LocalSGD and
  DiLoCo: the weights or their change, every ``sync_steps`` steps), at the inter-node bandwidth (groups are
  separate launches, normally separate nodes); it counts as exposed data-parallel communication. Memory: the
  estimator's (fault_tolerance/estimate.py).
An axis's traffic uses the intra-node bandwidth when the ranks it spans (TP innermost, then CP,
dp_shard, dp_replicate, pp outermost) fit in one node of ``gpus_per_node``, else inter-node.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import time
from dataclasses import dataclass, field

from torchtitan.build import build_meta_model, build_model_args
from torchtitan.components.optim.param_groups import optimizer_state_by_group
from torchtitan.components.seams import PlanTerms
from torchtitan.config.sections.optimizer import Optimizer as OptimizerConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.dtypes import to_dtype
from torchtitan.estimation.estimate import estimate_memory, named_shapes
from torchtitan.estimation.fake_trainer import resolve_vocab
from torchtitan.features.registry import plan_terms
from torchtitan.observability.flops import GPU_PEAK_FLOPS
from torchtitan.observability.metrics import model_flops_per_token
from torchtitan.preflight import run_preflight
from torchtitan.spec import get_model_spec

GIB = 2**30
MODEL_EFFICIENCY = 0.5  # achievable fraction of peak FLOP/s for large matmuls
OP_AC_RECOMPUTE = 1.1  # selective op AC recomputes the cheap ops, not the matmuls and attention
AC_MODES = ("none", "op", "full")
FLOAT8_GEMM_SPEEDUP = 1.5  # of the linears' matmuls, vs bf16 (torchtitan's Llama 3.1 8B: +28% end to end)
_AC_COMPUTE = {"none": 1.0, "op": OP_AC_RECOMPUTE, "full": 4 / 3}


@dataclass(frozen=True)
class Hardware:
    gpu: str = "H100"
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # GB/s per GPU (NVLink 4)
    inter_node_gbps: float = 50.0  # GB/s per GPU (400 Gb/s InfiniBand)

    @property
    def peak_flops(self) -> float:
        peaks = dict(GPU_PEAK_FLOPS)
        if self.gpu not in peaks:
            raise ValueError(f"--gpu {self.gpu!r}: known are {', '.join(peaks)}")
        return peaks[self.gpu].bf16 * 1e12


@dataclass(frozen=True)
class Layout:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1
    ac: str = "none"
    microbatches: int = 0  # 0: no PP

    def describe(self) -> str:
        mb = f" mb={self.microbatches}" if self.pp > 1 else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (
            f"pp={self.pp} dp_rep={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp}{ep}"
            f" ac={self.ac}{mb}"
        )


@dataclass
class PlanRow:
    layout: Layout
    peak_bytes: int
    step_seconds: float
    tokens_per_second_per_gpu: float
    parts: dict[str, float] = field(default_factory=dict)  # compute, exposed comm, bubble (seconds)


@dataclass
class Plan:
    world_size: int
    memory_gib: float
    global_batch: int
    rows: list[PlanRow]  # those that fit, best first
    considered: int
    estimated: int
    rejected: dict[str, int]
    seconds: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _global_batch(config, world_size: int) -> int:
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    return dims.dp_degree * config.training.batch_size * config.training.gradient_accumulation_steps


def enumerate_layouts(config, args, world_size: int, hw: Hardware) -> list[Layout]:
    """Every base layout (AC none) the trainer's validation would accept at this world size."""
    moe = getattr(args, "num_experts", 0) > 0
    out = []
    for tp in (t for t in _divisors(world_size) if t <= hw.gpus_per_node):
        for cp in (c for c in _divisors(world_size // tp) if c * tp <= hw.gpus_per_node):
            for pp in (p for p in _divisors(world_size // (tp * cp)) if p == 1 or 2 * p <= args.n_layers):
                dp = world_size // (tp * cp * pp)
                # FSDP across all data-parallel ranks, or HSDP with one shard group per node
                node_shard = hw.gpus_per_node // (tp * cp)
                replicate_degrees = {1} | ({dp // node_shard} if node_shard > 1 and dp % node_shard == 0 else set())
                for rep in sorted(replicate_degrees):
                    mbs = [0] if pp == 1 else [pp, 2 * pp]
                    eps = _ep_degrees(args, tp, dp // rep) if moe else [1]
                    out += [Layout(pp, rep, dp // rep, cp, tp, ep, "none", mb) for ep in eps for mb in mbs]
    return out


def _ep_degrees(args, tp: int, dp_shard: int) -> list[int]:
    """EP degrees the mesh allows (parallel_dims.py): ep divides num_experts; with TP, ep is a
    multiple of tp (> 1); ep / tp (or ep) divides dp_shard."""
    out = []
    for ep in _divisors(args.num_experts):
        if tp > 1 and (ep % tp or ep == 1):
            continue
        if dp_shard % (ep // tp if tp > 1 else ep) == 0:
            out.append(ep)
    return out


def _with_overrides(config, layout: Layout, local_batch: int):
    c = copy.deepcopy(config)
    t, exp, ac = c.training, c.experimental, c.activation_checkpoint
    exp.pipeline_parallel_degree, t.data_parallel_replicate_degree = layout.pp, layout.dp_replicate
    t.data_parallel_shard_degree, exp.context_parallel_degree = layout.dp_shard, layout.cp
    t.tensor_parallel_degree, exp.expert_parallel_degree, t.batch_size = layout.tp, layout.ep, local_batch
    ac.mode = {"none": "none", "op": "selective", "full": "full"}[layout.ac]
    ac.selective_ac_option = "op"
    if layout.pp > 1:
        exp.pipeline_parallel_microbatches = layout.microbatches
        exp.pipeline_parallel_split_points = []
    return c


def feature_terms(config) -> PlanTerms:
    """The one enabled feature's planner terms (the registry's ``Feature.plan``), or the base's."""
    found = plan_terms(config)
    assert len(found) <= 1, f"two features change the planner's terms: {found}"
    return found[0] if found else PlanTerms()


def lower_bound_bytes(args, layout: Layout, config) -> int:
    """Parameters + gradients + AdamW state per rank, sharded over everything that shards them.

    With the optimizer step in backward the gradients never live all at once: they are left out. A feature
    that trains part of the model (``PlanTerms``, components/seams.py: LoRA's adapters) says what trains and what its state costs.
    """
    terms = feature_terms(config)
    params = sum(_param_counts(config, args))
    trainable = terms.trainable(config, args, params)
    shards = layout.tp * layout.pp * layout.dp_shard * layout.cp
    grads = 0 if config.optimizer.early_step_in_backward else to_dtype(config.training.dtype).itemsize
    state_bytes = terms.state_bytes(config, args, trainable)
    if state_bytes is None:
        state_bytes = _state_bytes(config, args)
    return int((terms.param_bytes(config, args, params) + trainable * grads + state_bytes) / shards)


def _state_bytes(config, args) -> int:
    """The whole model's optimizer state, per param group (AdamW 2 moments, Muon 1 momentum)."""
    return _state_bytes_of(config.model.name, args, json.dumps(dataclasses.asdict(config.optimizer), sort_keys=True))


@functools.cache
def _state_bytes_of(model_name: str, args, optimizer_json: str) -> int:
    optimizer = OptimizerConfig(**json.loads(optimizer_json))  # a cache key: the section as JSON
    return sum(g["state_bytes"] for g in optimizer_state_by_group(named_shapes(model_name, args), optimizer))


def _param_counts(config, args) -> tuple[int, int]:
    """(embedding + output, the rest) parameter counts of the family's model on the meta device."""
    return _meta_param_counts(config.model.name, args)


@functools.cache
def _meta_param_counts(model_name: str, args) -> tuple[int, int]:
    model = build_meta_model(get_model_spec(model_name), args)
    ends = sum(p.numel() for name, p in model.named_parameters() if name.split(".")[0] in ("tok_embeddings", "output"))
    return ends, sum(p.numel() for p in model.parameters()) - ends


def throughput(args, layout: Layout, config, global_batch: int, world_size: int, hw: Hardware) -> PlanRow:
    """Step time and tokens/s per GPU of a layout under the model in the module docstring (peak filled later)."""
    seq, bytes_param = config.training.seq_len, 2 if config.training.mixed_precision_param == "bfloat16" else 4
    embed, rest = _param_counts(config, args)
    flops_per_token = model_flops_per_token(rest + embed // 2, args, seq)
    f8 = config.float8
    if f8.enable_float8_linear:  # the linears' 6N share runs float8 GEMMs
        linear = 6 * (rest + embed // 2)
        flops_per_token += linear / FLOAT8_GEMM_SPEEDUP - linear
    tokens = global_batch * seq
    compute = tokens * flops_per_token * _AC_COMPUTE[layout.ac] / (world_size * hw.peak_flops * MODEL_EFFICIENCY)
    dp = layout.dp_replicate * layout.dp_shard
    local_tokens = tokens / dp  # per data-parallel rank; TP/CP/PP ranks split them further
    act_bytes = local_tokens / layout.cp * args.dim * bytes_param  # one layer's activation per rank group
    bw = _bandwidths(layout, hw)
    layers = args.n_layers / layout.pp
    # TP (sequence parallel): 2 all-gathers + 2 reduce-scatters per layer forward, as many backward
    tp_bytes = 8 * layers * act_bytes * (layout.tp - 1) / layout.tp if layout.tp > 1 else 0.0
    kv_dim = (args.n_kv_heads or args.n_heads) * args.head_dim
    cp_bytes = (
        6 * layers * (local_tokens / layout.cp) * kv_dim * bytes_param * (layout.cp - 1) if layout.cp > 1 else 0.0
    )
    shard_bytes = (embed + rest) / (layout.tp * layout.pp) * bytes_param  # this rank's model slice, unsharded
    # forward and backward all-gathers, then the gradients' reduce-scatter
    gathers = (
        2 * shard_bytes / bytes_param
        if f8.enable_float8_linear and f8.enable_fsdp_float8_all_gather
        else 2 * shard_bytes
    )
    fsdp_bytes = (gathers + shard_bytes) * (layout.dp_shard * layout.cp - 1) / (layout.dp_shard * layout.cp)
    hsdp_bytes = 2 * shard_bytes / (layout.dp_shard * layout.cp) * (layout.dp_replicate - 1) / layout.dp_replicate
    exposed = tp_bytes / bw["tp"] + cp_bytes / bw["cp"]
    dp_time = fsdp_bytes / bw["dp_shard"] + hsdp_bytes / bw["dp_replicate"]
    bubble = compute * (layout.pp - 1) / layout.microbatches if layout.pp > 1 else 0.0
    shard_params = (embed + rest) / (layout.tp * layout.pp * layout.dp_shard * layout.cp)
    feature_time = feature_terms(config).comm_seconds(config, shard_params, hw.inter_node_gbps * 1e9)
    step = compute + exposed + max(0.0, dp_time - compute) + feature_time + bubble
    parts = {
        "compute": compute,
        "tp/cp comm": exposed,
        "dp comm (exposed)": max(0.0, dp_time - compute) + feature_time,
        "pp bubble": bubble,
    }
    return PlanRow(layout, 0, step, tokens / (step * world_size), parts)


def _bandwidths(layout: Layout, hw: Hardware) -> dict[str, float]:
    """Bytes/s of each axis: intra-node while the ranks up to and including it fit in one node."""
    span, out = 1, {}
    for axis, size in (
        ("tp", layout.tp),
        ("cp", layout.cp),
        ("dp_shard", layout.dp_shard),
        ("dp_replicate", layout.dp_replicate),
        ("pp", layout.pp),
    ):
        span *= size
        out[axis] = (hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps) * 1e9
    return out


def make_plan(config, world_size: int, memory_gib: float, hw: Hardware, *, top: int = 10, log=print) -> Plan:
    """Enumerate, rank by the throughput model, then estimate memory best-first until ``top`` fit.

    Every (layout, AC mode) gets its modeled step time first (cheap); the memory estimate (fake
    runs) then goes down that list, skipping a layout once a faster AC mode of it fits, and stops
    after ``top`` layouts fit: the estimator's seconds go to the layouts that could win. Under PP
    the plan estimates the first and the last pipeline rank (the first holds the most in-flight
    micro-batches, the last the output and loss); a plain estimate of the chosen layout shows all.
    ``log`` gets one line per estimated candidate.
    """
    start = time.perf_counter()
    budget = memory_gib * GIB
    vocab, _ = resolve_vocab(config)
    args = build_model_args(config, get_model_spec(config.model.name), vocab)
    global_batch = _global_batch(config, world_size)
    rejected: dict[str, int] = {}

    def reject(why: str) -> None:
        rejected[why] = rejected.get(why, 0) + 1

    candidates, considered = [], 0
    for base in enumerate_layouts(config, args, world_size, hw):
        dp = base.dp_replicate * base.dp_shard
        if global_batch % (dp * config.training.gradient_accumulation_steps):
            reject("global batch not divisible by dp")
            continue
        considered += 1
        if lower_bound_bytes(args, base, config) > budget:
            reject("parameters + gradients + optimizer state alone exceed the budget")
            continue
        local_batch = global_batch // (dp * config.training.gradient_accumulation_steps)
        for ac in AC_MODES:
            layout = Layout(**{**base.__dict__, "ac": ac})
            candidates.append((throughput(args, layout, config, global_batch, world_size, hw), local_batch))
    candidates.sort(key=lambda c: -c[0].tokens_per_second_per_gpu)
    rows, fitted, estimated = [], set(), 0
    for row, local_batch in candidates:
        base = Layout(**{**row.layout.__dict__, "ac": "none"})
        if base in fitted:
            continue  # a faster AC mode of this layout already fits
        if len(rows) >= top:
            break
        candidate = _with_overrides(config, row.layout, local_batch)
        try:
            run_preflight(candidate, world_size, this_machine=False)
        except (ValueError, NotImplementedError) as e:
            reject(f"invalid: {str(e).split(';')[0][:70]}")
            continue
        est = estimate_memory(candidate, world_size, pp_ranks="ends")
        estimated += 1
        fits = est.peak <= budget
        log(f"  {row.layout.describe():<62} peak {est.peak / GIB:8.2f} GiB {'fits' if fits else 'does not fit'}")
        if fits:
            row.peak_bytes = est.peak
            rows.append(row)
            fitted.add(base)
    return Plan(
        world_size, memory_gib, global_batch, rows, considered, estimated, rejected, time.perf_counter() - start
    )


def format_plan(plan: Plan, title: str, top: int) -> str:
    out = [
        f"{title}: {plan.world_size} ranks, {plan.memory_gib:g} GiB each, global batch {plan.global_batch} "
        f"sequences; {plan.considered} layouts considered, {plan.estimated} estimated best-first by the throughput "
        f"model, "
        f"{len(plan.rows)} fit ({plan.seconds:.0f} s)"
    ]
    out.append(
        f"{'#':>3}  {'layout':<62}{'peak GiB':>10}{'step s':>9}{'tok/s/GPU':>11}  "
        "compute / tp+cp comm / exposed dp comm / bubble (s)"
    )
    for i, r in enumerate(plan.rows[:top], 1):
        p = r.parts
        out.append(
            f"{i:>3}  {r.layout.describe():<62}{r.peak_bytes / GIB:>10.2f}{r.step_seconds:>9.2f}"
            f"{r.tokens_per_second_per_gpu:>11,.0f}  {p['compute']:.2f} / {p['tp/cp comm']:.2f} / "
            f"{p['dp comm (exposed)']:.2f} / {p['pp bubble']:.2f}"
        )
    for why, n in sorted(plan.rejected.items()):
        out.append(f"rejected: {n} x {why}")
    return "\n".join(out)


def plan_to_dict(plan: Plan) -> dict:
    return {
        "world_size": plan.world_size,
        "memory_gib": plan.memory_gib,
        "global_batch": plan.global_batch,
        "considered": plan.considered,
        "estimated": plan.estimated,
        "rejected": plan.rejected,
        "seconds": round(plan.seconds, 1),
        "fits": [
            {
                "layout": r.layout.__dict__,
                "peak_bytes": r.peak_bytes,
                "step_seconds": r.step_seconds,
                "tokens_per_second_per_gpu": r.tokens_per_second_per_gpu,
                "parts": r.parts,
            }
            for r in plan.rows
        ],
    }
