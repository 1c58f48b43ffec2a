"""training.cuda_graphs (features/cuda_graphs/checks.py): its one-line refusals before launch, and the compile mode it
gives the dense blocks (distributed/parallelize.py ``apply_compile``). The CUDA graphs themselves need a GPU: the GPU
check's compile section measures them (bench/gpu_check, docs/performance.md)."""

from __future__ import annotations

import re

import pytest
import torch

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import apply_compile
from torchtitan.features.cuda_graphs.checks import check_cuda_graphs
from torchtitan.preflight import run_preflight
from torchtitan.spec import flavor_args, get_model_spec

ON = ["--training.compile", "--training.cuda_graphs"]
DEBUG = ["--model.flavor", "debugmodel_tiny"]


def _check(flags: list[str], *, world_size: int = 1, device_type: str = "cuda") -> list[str]:
    """The pre-launch check of ``flags`` for a run on ``device_type`` (another machine's files not read)."""
    config = JobConfig.parse_args(flags, world_size=world_size)
    return run_preflight(config, world_size, this_machine=False, device_type=device_type)


def _config_check(flags: list[str], *, world_size: int = 1) -> list[str]:
    """The feature's own config check alone (the family's check not run: hf's imports transformers, ~5 s)."""
    config = JobConfig.parse_args(flags, world_size=world_size)
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=world_size)
    return check_cuda_graphs(config, dims)


def test_off_cuda_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        _check([*ON, *DEBUG], device_type="cpu")
    assert str(e.value) == "training.cuda_graphs needs a CUDA device; this run's device is cpu"
    assert _check([*ON, *DEBUG]) == []  # one process on CUDA: built
    assert _check([*ON, *DEBUG], device_type=None) == []  # the device unknown (the estimator, --target): not judged


def test_refused_with_a_memory_budget():
    with pytest.raises(NotImplementedError) as e:
        _check([*ON, *DEBUG, "--activation_checkpoint.mode", "memory_budget"])
    line = str(e.value)
    assert line.startswith("training.cuda_graphs = true with activation_checkpoint.mode = 'memory_budget'"), line
    assert "\n" not in line


def test_needs_compile():
    with pytest.raises(ConfigError, match=r"^training.cuda_graphs = true needs training.compile = true: .*; set "):
        _check(["--training.cuda_graphs", *DEBUG])
    assert _check(["--training.compile", *DEBUG], device_type="cpu") == []  # off by default: nothing to refuse


@pytest.mark.parametrize(
    "family, flavor", [("qwen3_moe", "debugmodel_tiny"), ("deepseek_v3", "debugmodel_tiny"), ("hf", "llama_tiny")]
)
def test_refused_for_moe_families_and_hf(family, flavor):
    with pytest.raises(NotImplementedError) as e:
        _config_check([*ON, "--model.name", family, "--model.flavor", flavor])
    line = str(e.value)
    assert line.startswith(f"training.cuda_graphs = true with model.name = '{family}'") and "\n" not in line, line
    assert line.endswith(
        "set training.cuda_graphs = false" + ("" if family == "hf" else " (MoE blocks compile without it)")
    )


def test_dense_families_pass():
    for family in ("llama3", "qwen3", "qwen3_5", "qwen3_5_vl"):
        assert _check([*ON, "--model.name", family, *DEBUG]) == [], family


@pytest.mark.parametrize(
    "flags, world_size, named",
    [
        (["--training.gradient_accumulation_steps", "2"], 1, "training.gradient_accumulation_steps = 2"),
        (["--experimental.pipeline_parallel_degree", "2"], 2, "experimental.pipeline_parallel_degree = 2"),
        ([], 2, "FSDP (data_parallel_shard_degree = 2)"),
        (
            ["--training.tensor_parallel_degree", "2", "--training.data_parallel_shard_degree", "1"],
            2,
            "training.tensor_parallel_degree = 2",
        ),
    ],
    ids=["accumulation", "pp", "fsdp", "tp"],
)
def test_refused_layouts(flags, world_size, named):
    with pytest.raises(NotImplementedError, match="^" + re.escape(f"training.cuda_graphs = true with {named}: ")):
        _config_check([*ON, *DEBUG, *flags], world_size=world_size)


def test_ddp_passes():
    ddp = ["--training.data_parallel_replicate_degree", "2", "--training.data_parallel_shard_degree", "1"]
    assert _check([*ON, *DEBUG, *ddp], world_size=2) == []


def _meta_model(family: str) -> torch.nn.Module:
    config = JobConfig.parse_args(["--model.name", family, *DEBUG])
    with torch.device("meta"):
        return get_model_spec(family).model_cls(flavor_args(config.model))


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_dense_blocks_compile_reduce_overhead(cuda_graphs, monkeypatch):
    """The mode each block is compiled in (torch.compile recorded, not run: the graphs need CUDA)."""
    calls = []

    def compile_(module, **kwargs):
        calls.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", compile_)
    model = _meta_model("llama3")
    apply_compile(model, tp_enabled=False, cuda_graphs=cuda_graphs)
    mode = {"mode": "reduce-overhead"} if cuda_graphs else {}  # else torch's default mode
    assert calls == [{"fullgraph": True, "backend": "inductor", **mode}] * len(model.layers), calls
    calls.clear()
    moe_model = _meta_model("llama3_moe")
    moes = set(moe_model.moe_layers())
    apply_compile(moe_model, tp_enabled=False)  # MoE blocks compile around the experts, never with CUDA graphs
    assert moes and [c["fullgraph"] for c in calls] == [n not in moes for n in moe_model.layers], calls
    assert all("mode" not in c for c in calls), calls
