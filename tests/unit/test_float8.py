"""Float8 (torchao) on CPU: a converted linear's numerics, which linears convert, and the refusals."""

from __future__ import annotations

import builtins
import copy

import pytest
import torch
from torch import nn

from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.config.schema import Float8
from torchtitan.features.float8 import float8 as f8
from torchtitan.features.float8.checks import check_float8_config
from torchtitan.models.llama import Transformer, llama3_configs
from torchtitan.preflight import run_preflight

# Relative error (Frobenius) of a Float8Linear against the same bf16 nn.Linear, worst of seeds 0-4
# (256 -> 512, 4 x 64 tokens), measured: tensorwise out 3.7e-2, grad_input 5.9e-2 (e5m2 output grads),
# grad_weight 5.9e-2; rowwise 3.6e-2 / 3.6e-2 / 3.8e-2. e4m3 keeps 3 mantissa bits (~3.6 % rms rounding
# per operand). Limits are 1.5x the worst; the lower bound 1e-2 fails a linear that stayed in bf16.
LIMITS = {
    "tensorwise": {"out": 0.06, "grad_input": 0.09, "grad_weight": 0.09},
    "rowwise": {"out": 0.06, "grad_input": 0.06, "grad_weight": 0.06},
    # weight grad in high precision: the bf16 linear's exactly
    "rowwise_with_gw_hp": {"out": 0.06, "grad_input": 0.06, "grad_weight": 0.0},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _converted(model: nn.Module, **cfg) -> list[str]:
    return f8.apply_float8(model, Float8(enable_float8_linear=True, **cfg))


def _skip_unless_this_torch_runs(recipe: str) -> None:
    """The rowwise recipes need torch 2.12+ on CPU; on an older torch the trainer refuses them in one line
    (test_rowwise_refusal_names_the_torch_it_needs), so their numerics are not this torch's to test."""
    try:
        f8.check_float8_runs(torch.device("cpu"), recipe)
    except NotImplementedError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("recipe", list(LIMITS))
def test_converted_linear_is_within_float8_rounding_of_bf16(recipe: str):
    _skip_unless_this_torch_runs(recipe)
    torch.manual_seed(0)
    ref = nn.Linear(256, 512, bias=False)
    model = nn.Sequential(copy.deepcopy(ref))
    assert _converted(model, recipe_name=recipe) == ["0"]
    ref, model = ref.to(torch.bfloat16), model.to(torch.bfloat16)
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    x8 = x.detach().clone().requires_grad_()
    grad = torch.randn(4, 64, 512, dtype=torch.bfloat16)
    out, out8 = ref(x), model(x8)
    out.backward(grad)
    out8.backward(grad)
    errors = {
        "out": _rel(out8, out),
        "grad_input": _rel(x8.grad, x.grad),
        "grad_weight": _rel(model[0].weight.grad, ref.weight.grad),
    }
    for key, limit in LIMITS[recipe].items():
        assert errors[key] <= limit, (recipe, errors)
        if limit > 0:
            assert errors[key] > 1e-2, f"{recipe} {key} equals bf16: not float8? {errors}"
    assert out8.dtype == torch.bfloat16


def test_filter_keeps_head_filtered_and_non_divisible_linears(caplog):
    args = llama3_configs["debugmodel"]
    with torch.device("meta"):
        model = Transformer(args)
        model.layers["0"].attention.wq = nn.Linear(args.dim, 40, bias=False)  # 40 is not a multiple of 16
    with caplog.at_level("INFO"):
        converted = _converted(model, filter_fqns=["layers.1.feed_forward"])
    from torchao.float8.float8_linear import Float8Linear

    assert not isinstance(model.output, Float8Linear)
    assert not isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert not any(isinstance(m, Float8Linear) for m in model.layers["1"].feed_forward.modules())
    assert isinstance(model.layers["1"].attention.wq, Float8Linear)
    assert len(converted) == 8 * 7 - 1 - 3  # 7 linears per block; minus the 40-wide wq and layer 1's FFN
    assert "output" not in converted
    log = caplog.text
    assert "output (the output head)" in log and "256x40 is not a multiple of 16" in log
    assert "float8.filter_fqns ('layers.1.feed_forward')" in log
    assert model.output.weight.dtype == model.layers["1"].attention.wq.weight.dtype  # same parameter dtypes


def test_conversion_keeps_parameter_names_and_dtypes():
    with torch.device("meta"):
        plain, converted = Transformer(llama3_configs["debugmodel"]), Transformer(llama3_configs["debugmodel"])
    _converted(converted)
    assert {k: (v.dtype, v.shape) for k, v in plain.state_dict().items()} == {
        k: (v.dtype, v.shape) for k, v in converted.state_dict().items()
    }


@pytest.mark.parametrize(
    "cfg, fsdp, error, match",
    [
        ({"enable_fsdp_float8_all_gather": True}, True, ConfigError, "needs float8.enable_float8_linear"),
        ({"enable_float8_linear": True, "recipe_name": "mxfp8"}, True, NotImplementedError, "mxfp8"),
        ({"enable_float8_linear": True, "scaling_type_input": "delayed"}, True, NotImplementedError, "delayed"),
        (
            {"enable_float8_linear": True, "recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True},
            True,
            ConfigError,
            "'tensorwise' recipe only",
        ),
        (
            {"enable_float8_linear": True, "precompute_float8_dynamic_scale_for_fsdp": True},
            True,
            ConfigError,
            "needs float8.enable_fsdp_float8_all_gather",
        ),
        ({"enable_float8_linear": True, "enable_fsdp_float8_all_gather": True}, False, ConfigError, "without FSDP"),
    ],
)
def test_bad_float8_config_is_refused(cfg: dict, fsdp: bool, error: type, match: str):
    with pytest.raises(error, match=match):
        check_float8_config(Float8(**cfg), fsdp_enabled=fsdp)


def test_ring_async_tp_takes_tensorwise_only():
    with pytest.raises(NotImplementedError, match="enable_async_tensor_parallel"):
        check_float8_config(
            Float8(enable_float8_linear=True, recipe_name="rowwise"), fsdp_enabled=False, ring_async_tp=True
        )


def test_missing_torchao_is_a_clear_error(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(NotImplementedError, match=r"needs torchao.*pip install torchao==0\.18\.0"):
        f8.check_float8_runs(torch.device("cpu"))


def test_this_cpu_build_runs_float8_gemms():
    f8.check_float8_runs(torch.device("cpu"))  # every supported torch's CPU build has tensorwise _scaled_mm


def test_rowwise_refusal_names_the_torch_it_needs(monkeypatch):
    """torch 2.11's CPU _scaled_mm asserts one scale per operand: rowwise is refused before the model is built."""
    real = torch._scaled_mm

    def tensorwise_only(a, b, *, scale_a, scale_b, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("(scale_a.numel() == 1 && scale_b.numel() == 1) INTERNAL ASSERT FAILED\nmore")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", tensorwise_only)
    f8._probe_rowwise_scaled_mm.cache_clear()
    try:
        f8.check_float8_runs(torch.device("cpu"), "tensorwise")
        with pytest.raises(NotImplementedError) as e:
            f8.check_float8_runs(torch.device("cpu"), "rowwise_with_gw_hp")
    finally:
        f8._probe_rowwise_scaled_mm.cache_clear()
    assert str(e.value) == (
        f"float8.recipe_name = 'rowwise_with_gw_hp' on device 'cpu' needs torch 2.12 or newer (torch "
        f"{torch.__version__}'s _scaled_mm takes one scale per operand there); use recipe_name = 'tensorwise'"
    )


def test_the_old_no_effect_warning_is_gone():
    config = JobConfig.parse_args(["--float8.enable_float8_linear"])
    warnings = run_preflight(config, 1)
    assert not any("float8" in w for w in warnings), warnings


def test_precompute_hook_is_chained_with_the_family_hooks():
    from torchtitan.spec import HookChain, chain_hooks

    class Family:
        calls = 0

        def aux_loss(self, model_part, scale):
            return torch.tensor(2.0)

        def reduce_step(self, *, keep_metrics, outer_sum):
            Family.reduced = keep_metrics

        def after_optimizer_step(self):
            Family.calls += 1

        def discard_step(self):
            pass

        def metrics(self):
            return {"a": 1}, {"b": 2.0}

    precompute = f8.Float8ScalePrecompute([nn.Linear(16, 16)])  # no float8 FSDP weights: a no-op
    chained = chain_hooks(Family(), precompute)
    assert isinstance(chained, HookChain) and chain_hooks(None, precompute) is precompute
    chained.reduce_step(keep_metrics=True, outer_sum=None)
    chained.after_optimizer_step()
    assert Family.calls == 1 and Family.reduced is True
    assert chained.aux_loss(nn.Linear(1, 1), 1.0).item() == 2.0 and chained.metrics() == ({"a": 1}, {"b": 2.0})


def test_planner_models_float8_gemms_and_all_gathers():
    import dataclasses

    from torchtitan.estimation.plan import FLOAT8_GEMM_SPEEDUP, Hardware, Layout, throughput

    args = dataclasses.replace(llama3_configs["8B"], vocab_size=128256)
    layout = Layout(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1)
    rows = {}
    for name, flags in {
        "bf16": [],
        "float8": ["--float8.enable_float8_linear"],
        "float8_ag": ["--float8.enable_float8_linear", "--float8.enable_fsdp_float8_all_gather"],
    }.items():
        config = JobConfig.parse_args(["--training.mixed_precision_param", "bfloat16", *flags])
        rows[name] = throughput(args, layout, config, global_batch=8, world_size=8, hw=Hardware())
    bf16, float8 = rows["bf16"].parts["compute"], rows["float8"].parts["compute"]
    assert bf16 / FLOAT8_GEMM_SPEEDUP < float8 < bf16  # linears faster, attention not
    assert rows["float8_ag"].tokens_per_second_per_gpu >= rows["float8"].tokens_per_second_per_gpu


@pytest.mark.parametrize("recipe", list(LIMITS))
def test_every_recipe_trains_under_cpu_autocast(recipe: str):
    """The trainer autocasts without FSDP; torchao casts a Float8Linear's input for CUDA autocast only."""
    _skip_unless_this_torch_runs(recipe)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    _converted(model, recipe_name=recipe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(8, 64))
    out.float().sum().backward()  # rowwise_with_gw_hp's high-precision weight grad mixed bf16 and fp32 before
    assert out.dtype == torch.bfloat16 and all(p.grad is not None for p in model.parameters())
