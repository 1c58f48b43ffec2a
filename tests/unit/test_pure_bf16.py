"""Pure bf16 training (training.dtype = "bfloat16"): the initial weights, the fp32 update written back to bf16
weights (to nearest or stochastically), the gradient norm of bf16 gradients, and what the preflight refuses.
The layouts' loss parity: tests/support/matrix.py (PURE_BF16_ROWS); the estimator: tests/runs/estimation/test_estimation.py."""

from __future__ import annotations

import pytest
import torch

from torchtitan.components.optim.optim_lowp import LowPrecisionAdamW, stochastic_round_
from torchtitan.components.optim.optimizer import build_optimizer
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.distributed.grad_norm import clip_grad_norm_
from torchtitan.distributed.init import cast_parameters_, init_model_weights
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.preflight import run_preflight

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=256, max_seq_len=64, tie_word_embeddings=True)


def _model(dtype: torch.dtype | None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(TINY)
    if dtype is not None:
        cast_parameters_(model, dtype)
    model.to_empty(device="cpu")
    init_model_weights(model, seed=3, buffer_device=torch.device("cpu"))
    return model


def test_bf16_weights_are_the_fp32_init_rounded_and_buffers_stay_fp32():
    fp32, bf16 = _model(None), _model(torch.bfloat16)
    want = {n: p.to(torch.bfloat16) for n, p in fp32.named_parameters()}
    got = dict(bf16.named_parameters())
    assert want.keys() == got.keys()
    for name, p in got.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, want[name]), name
    assert bf16.output.weight is bf16.tok_embeddings.weight  # the tied head stays one parameter
    assert all(b.dtype == torch.float32 for b in bf16.buffers())  # the RoPE table


def test_stochastic_rounding_is_exact_on_bf16_values_and_unbiased_between_them():
    g = torch.Generator().manual_seed(0)
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625, float("inf"), -float("inf")])  # all representable in bf16
    out = torch.empty(6, dtype=torch.bfloat16)
    assert torch.equal(stochastic_round_(out, exact, g).float(), exact)
    # 1 + 2^-9: a quarter of bf16's last-bit step (2^-7) above 1.0; rounds to 1 + 2^-7 with probability 1/4.
    x = torch.full((200_000,), 1.0 + 2**-9)
    for sign in (1.0, -1.0):
        r = stochastic_round_(torch.empty_like(x, dtype=torch.bfloat16), sign * x, g).float()
        assert set(r.abs().unique().tolist()) == {1.0, 1.0 + 2**-7}
        up = (r.abs() > 1.0).float().mean().item()
        assert abs(up - 0.25) < 0.01, up  # binomial sd 0.001
        assert abs(r.mean().item() - sign * (1.0 + 2**-9)) < 1e-4
    assert torch.equal(x.to(torch.bfloat16), torch.ones(200_000, dtype=torch.bfloat16))  # nearest loses it


def _bf16_params_run(stochastic: bool, steps: int = 20, lr: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 weights, fp32-weights reference) after ``steps`` AdamW steps of fixed gradients, from the same start."""
    w32 = torch.nn.Parameter(torch.full((4096,), 1.0))
    w16 = torch.nn.Parameter(w32.detach().to(torch.bfloat16))
    opts = [
        LowPrecisionAdamW([w32], lr=lr, weight_decay=0.0, state_dtype="float32"),
        LowPrecisionAdamW([w16], lr=lr, weight_decay=0.0, state_dtype="bfloat16", stochastic_round=stochastic),
    ]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grad = torch.randn(4096, generator=g).abs() + 0.1  # every weight moves down by ~lr a step
        w32.grad, w16.grad = grad, grad.to(torch.bfloat16)
        for opt in opts:
            opt.step()
    return w16.detach().float(), w32.detach()


def test_small_updates_are_lost_to_nearest_and_kept_on_average_by_stochastic_rounding():
    """lr 1e-4 moves a weight of 1.0 by ~1e-4 a step, under bf16's half step (2^-8 ~ 3.9e-3) below 1.0."""
    nearest, ref = _bf16_params_run(stochastic=False)
    stochastic, _ = _bf16_params_run(stochastic=True)
    moved = 1.0 - ref.mean().item()  # ~2e-3 over 20 steps
    assert moved > 1e-3
    assert nearest.eq(1.0).all()  # every update rounded away
    assert abs((1.0 - stochastic.mean().item()) - moved) < 0.1 * moved


def test_stochastic_rounding_is_a_function_of_the_step_and_parameter():
    """Two optimizers over equal replicas (TP/DDP ranks) keep them equal; a resume draws the same bits."""
    a, _ = _bf16_params_run(stochastic=True)
    b, _ = _bf16_params_run(stochastic=True)
    assert torch.equal(a, b)


def test_build_optimizer_takes_the_fp32_update_for_bf16_parameters():
    model = _model(torch.bfloat16)
    config = JobConfig.parse_args(["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"])
    assert config.optimizer.state_dtype == "bfloat16"  # the moments follow training.dtype unless set
    opt = build_optimizer([model], config.optimizer)
    assert isinstance(opt, LowPrecisionAdamW) and opt.state_dtype == torch.bfloat16
    fp32_moments = build_optimizer([model], OptimizerConfig(state_dtype="float32"))
    assert isinstance(fp32_moments, LowPrecisionAdamW) and fp32_moments.state_dtype == torch.float32
    assert JobConfig.parse_args([]).optimizer.state_dtype == "float32"


def test_grad_norm_of_bf16_gradients_accumulates_in_fp32():
    grads = torch.randn(3, 100_000, generator=torch.Generator().manual_seed(0))
    params = [torch.nn.Parameter(torch.zeros(100_000, dtype=torch.bfloat16)) for _ in range(3)]
    for p, g in zip(params, grads):
        p.grad = g.to(torch.bfloat16)
    want = torch.linalg.vector_norm(torch.stack([p.grad.double() for p in params])).item()
    got = clip_grad_norm_(params, 0.0)
    # measured 1.2e-6 relative; each norm rounded to bf16 first (8 bits) was 9.0e-4 off
    assert got.dtype == torch.float32 and abs(got.item() - want) <= 1e-5 * want


@pytest.mark.parametrize(
    "extra, error, match",
    [
        (["--training.mixed_precision_param", "float32"], ConfigError, "no fp32 copy to compute in"),
        (["--optimizer.fused", "true"], ConfigError, "optimizer.fused = true: torch's fused Adam"),
        (["--optimizer.name", "Muon"], NotImplementedError, "with Muon: its update is applied"),
        (["--lora.enable"], NotImplementedError, "with lora.enable: not built"),
        (["--float8.enable_float8_linear"], NotImplementedError, "with float8.enable_float8_linear"),
    ],
    ids=["compute_fp32", "fused", "muon", "lora", "float8"],
)
def test_what_does_not_compose_is_refused_in_one_line(extra, error, match):
    base = ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"]
    with pytest.raises(error, match=match) as e:
        run_preflight(JobConfig.parse_args([*base, *extra]), world_size=1)
    assert "\n" not in str(e.value) and "training.dtype = 'bfloat16'" in str(e.value)


def test_stochastic_rounding_without_bf16_weights_is_refused():
    with pytest.raises(ConfigError, match="bf16_stochastic_round = true with training.dtype = 'float32'"):
        run_preflight(JobConfig.parse_args(["--optimizer.bf16_stochastic_round"]), world_size=1)
