"""QLoRA (``lora.quantize_base = 'nf4'``), single process: NF4's error against its format's bound, the NF4 model
against the model of its dequantized weights, gradients, the planner's NF4 bytes and the one-line refusals.
Through the trainer (losses, FSDP2, frozen base, checkpoints, the estimator): tests/runs/features/test_qlora_runs.py.

NF4's error, derived from the format (torchao's NF4Tensor, the QLoRA paper's block sizes): a block of 64 elements
is scaled by its absmax s and each element rounded to the nearest of 16 levels in [-1, 1], so the code's error is at
most half the widest gap between levels (0.1519 s: the gap -1 .. -0.6962); the scale is stored double-quantized
(s minus the tensor's mean scale, int8 over groups of 256 scales with the factor 127.5 / D, D the group's largest
|s - mean|), off by at most D / 128 (a half step, or a whole one where the top value is clamped to 127), times a
level of at most 1. Per element: |w - dequant(w)| <= 0.1519 s + D / 128.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchtitan.build import build_model, build_model_args
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.features.lora.linear import LoRALinear
from torchtitan.features.lora.quantize import NF4_BLOCK, NF4_SCALER_BLOCK, nf4_bytes, quantize_base, to_nf4
from torchtitan.spec import get_model_spec

pytest.importorskip("torchao")
# the debug flavor (dim 256): every target holds whole groups of 64 x 256 elements, the tiny flavor's do not
DEBUG = ["--job.config_file", "./train_configs/debug_model.toml", "--model.flavor", "debugmodel"]
QLORA = ["--lora.enable", "--lora.rank", "4", "--lora.quantize_base", "nf4"]


def _model(*extra: str) -> nn.Module:
    cfg = JobConfig.parse_args([*DEBUG, "--training.seed", "7", *extra])
    args = build_model_args(cfg, get_model_spec(cfg.model.name), 512, device_type="cpu")
    dims = ParallelDims.from_sections(training=cfg.training, experimental=cfg.experimental, world_size=1)
    return build_model(cfg, args, dims, None, torch.device("cpu"))


def _bound(w: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """The per-element error bound of the module docstring, shaped like ``w``."""
    half_gap = (levels[1:] - levels[:-1]).max() / 2
    scales = w.detach().reshape(-1, NF4_BLOCK).abs().amax(dim=1)  # s per block
    deviation = (scales - scales.mean()).reshape(-1, NF4_SCALER_BLOCK).abs().amax(dim=1)  # D per group
    per_block = half_gap * scales + deviation.repeat_interleave(NF4_SCALER_BLOCK) / 128
    return per_block.repeat_interleave(NF4_BLOCK).reshape(w.shape) * (1 + 1e-5)  # + fp32 rounding


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    """The LoRA model (fp32 base; B = 0, so the base model's logits), its QLoRA copy, and a copy whose base is the
    NF4 weights dequantized into plain fp32 tensors."""
    fp = _model("--lora.enable", "--lora.rank", "4")
    nf4, dequantized = copy.deepcopy(fp), copy.deepcopy(fp)
    assert quantize_base([nf4]) == 8 * 7
    for (_, q), (_, d) in zip(nf4.named_modules(), dequantized.named_modules(), strict=True):
        if isinstance(q, LoRALinear):
            d.weight = nn.Parameter(q.weight.get_original_weight(), requires_grad=False)
    return {"fp": fp, "nf4": nf4, "dequantized": dequantized}


def test_nf4_weights_are_within_the_format_bound(models):
    worst, rms = 0.0, []
    for (name, q), (_, f) in zip(models["nf4"].named_modules(), models["fp"].named_modules(), strict=True):
        if not isinstance(q, LoRALinear):
            continue
        err = (q.weight.get_original_weight() - f.weight).abs()
        bound = _bound(f.weight, q.weight.nf4)
        assert (err <= bound).all(), (name, (err / bound).max().item())
        worst = max(worst, (err / bound).max().item())
        rms.append((err.square().mean() / f.weight.square().mean()).sqrt().item())
    print(f"NF4 error / bound at most {worst:.3f}; relative RMS error of the weights {min(rms):.4f}-{max(rms):.4f}")
    assert 0.02 < min(rms) and max(rms) < 0.15  # ~0.09: 4 bits on Gaussian weights (none exact, none wild)


def test_nf4_logits_equal_the_dequantized_model_and_stay_near_the_base(models):
    """The NF4 model computes exactly what a model of its dequantized weights does (F.linear dequantizes per call);
    against the fp32 base its logits move by less than the weights' own relative error bound (the largest
    ||bound||_F / ||W||_F over the targets)."""
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp, nf4, dequantized = (models[k](tokens) for k in ("fp", "nf4", "dequantized"))
    assert torch.equal(nf4, dequantized)
    fps = [m for m in models["fp"].modules() if isinstance(m, LoRALinear)]
    levels = next(m for m in models["nf4"].modules() if isinstance(m, LoRALinear)).weight.nf4
    tolerance = max((_bound(m.weight, levels).norm() / m.weight.norm()).item() for m in fps)
    rel = ((nf4 - fp).norm() / fp.norm()).item()
    print(f"logits: NF4 vs fp32 base relative error {rel:.4f} (tolerance {tolerance:.4f}); vs dequantized: 0")
    assert 0 < rel <= tolerance


def test_gradient_reaches_the_input_and_the_adapters_not_the_nf4_weight():
    torch.manual_seed(0)
    layer = LoRALinear(256, 128, rank=4, alpha=8.0)
    layer.init_adapter()
    nn.init.normal_(layer.lora_b.weight)
    layer.weight.requires_grad_(False)
    dense = copy.deepcopy(layer)
    layer.weight = nn.Parameter(to_nf4(layer.weight), requires_grad=False)
    dense.weight = nn.Parameter(layer.weight.get_original_weight(), requires_grad=False)
    x = torch.randn(3, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    layer(x).square().sum().backward()
    dense(x2).square().sum().backward()
    assert layer.weight.grad is None
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(layer.lora_a.weight.grad, dense.lora_a.weight.grad)
    torch.testing.assert_close(layer.lora_b.weight.grad, dense.lora_b.weight.grad)


def test_nf4_bytes_are_torchaos_storage():
    """0.5 byte per element + an int8 scale per 64 + an fp32 factor per 64 x 256, + the mean and the 16-level table:
    0.515869 byte per element (vs 4 in fp32: 7.75x less)."""
    w = torch.randn(512, 256)
    q = to_nf4(w)
    inner = [getattr(q, n) for n in q.__tensor_flatten__()[0]]
    assert nf4_bytes(w.numel()) == sum(t.numel() * t.element_size() for t in inner)
    per_element = 0.5 + 1 / 64 + 4 / (64 * 256)
    assert nf4_bytes(4096 * 14336) == pytest.approx(4096 * 14336 * per_element, abs=100)


def test_planner_floor_counts_nf4_for_the_adapted_base():
    from torchtitan.estimation.plan import Layout, lower_bound_bytes
    from torchtitan.features.lora.estimate import adapter_param_count
    from torchtitan.spec import flavor_args

    argv = ["--job.config_file", "./train_configs/llama3_8b.toml", "--lora.enable", "--lora.rank", "16"]
    lora, qlora = JobConfig.parse_args(argv), JobConfig.parse_args([*argv, "--lora.quantize_base", "nf4"])
    args, layout = flavor_args(lora.model), Layout(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    adapters, params = adapter_param_count(lora, args.n_layers), 8_030_261_248
    linears = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)  # q o, k v, ffn: the NF4 part
    nf4 = 32 * (2 * nf4_bytes(4096 * 4096) + 2 * nf4_bytes(1024 * 4096) + 3 * nf4_bytes(4096 * 14336))
    assert lower_bound_bytes(args, layout, qlora) == (params - linears) * 4 + nf4 + adapters * 12
    assert lower_bound_bytes(args, layout, qlora) < 9 * 2**30 < 24 * 2**30 < lower_bound_bytes(args, layout, lora)


@pytest.mark.parametrize(
    ("extra", "world_size", "expected"),
    [
        (["--lora.quantize_base", "int4"], 1, "config key 'lora.quantize_base': got 'int4' (str), expected 'none' |"),
        (["--lora.quantize_base", "nf4"], 1, "lora.quantize_base = 'nf4' without lora.enable"),
        ([*QLORA, "--training.tensor_parallel_degree", "2"], 2, "with training.tensor_parallel_degree > 1: not built"),
        ([*QLORA, "--experimental.pipeline_parallel_degree", "2"], 2, "with experimental.pipeline_parallel_degree"),
        ([*QLORA, "--experimental.context_parallel_degree", "2"], 2, "with experimental.context_parallel_degree"),
        ([*QLORA, "--training.data_parallel_replicate_degree", "2"], 2, "training.data_parallel_replicate_degree"),
        ([*QLORA, "--model.flavor", "debugmodel_tiny"], 1, "target wq is (64, 64); NF4 quantizes groups of 16384"),
    ],
    ids=["value", "without-lora", "tp", "pp", "cp", "ddp", "shapes"],
)
def test_bad_qlora_input_is_one_line_and_exit_2(extra, world_size, expected, capsys, monkeypatch):
    from tests.support.runs import ROOT, error_lines
    from torchtitan.preflight.__main__ import main

    monkeypatch.chdir(ROOT)
    code = main(["--world_size", str(world_size), *DEBUG, *extra])
    out = capsys.readouterr()
    lines = error_lines(out.err + out.out)
    assert code == 2 and len(lines) == 1 and expected in lines[0], out.err
    assert "Traceback" not in out.err + out.out


def test_qlora_without_torchao_is_one_line(capsys, monkeypatch):
    import importlib.util

    from tests.support.runs import ROOT, error_lines
    from torchtitan.preflight.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    monkeypatch.chdir(ROOT)
    code = main(["--world_size", "1", *DEBUG, *QLORA])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert (
        "lora.quantize_base = 'nf4' needs torchao, which is not installed; pip install 'torchtitan[lora]'" in lines[0]
    )
