"""Muon beside AdamW (components/optim/muon.py) on one process against torch.optim.Muon + torch.optim.AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from torchtitan.components.optim.muon import MuonAdam, compute_orthogonalized
from torchtitan.components.optim.optimizer import build_optimizer
from torchtitan.components.optim.param_groups import MUON_NS_COEFFICIENTS
from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.models.llama.model import ModelArgs, Transformer

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16)


def _hidden(name: str, p: torch.Tensor) -> bool:
    return name.startswith("layers.") and p.ndim == 2


def _steps(models_opts, steps: int = 3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        for model, opts in models_opts:
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()


@pytest.mark.parametrize(
    "adjust,nesterov,muon_lr", [("original", True, None), ("match_rms_adamw", False, None), ("original", True, 0.02)]
)
def test_muon_equals_torch_muon_plus_adamw(adjust, nesterov, muon_lr):
    torch.manual_seed(0)
    model = Transformer(TINY)
    ref = copy.deepcopy(model)
    cfg = OptimizerConfig(
        name="Muon", lr=3e-3, muon_lr=muon_lr, muon_adjust_lr_fn=adjust, muon_nesterov=nesterov, muon_momentum=0.9
    )
    opt = build_optimizer([model], cfg)
    assert isinstance(opt, MuonAdam)
    named = list(ref.named_parameters())
    ref_muon = torch.optim.Muon(
        [p for n, p in named if _hidden(n, p)],
        lr=muon_lr or 3e-3,
        weight_decay=0.1,
        momentum=0.9,
        nesterov=nesterov,
        adjust_lr_fn=adjust,
    )
    ref_adamw = torch.optim.AdamW(
        [p for n, p in named if not _hidden(n, p)], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    _steps([(model, [opt]), (ref, [ref_muon, ref_adamw])])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5, msg=n)
    muon_params = [p for n, p in model.named_parameters() if _hidden(n, p)]
    assert set(opt.state[muon_params[0]]) == {"momentum_buffer"}


def test_expert_stack_is_orthogonalised_per_expert():
    g = torch.Generator().manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 8, 5, generator=g))
    ref = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    opt = MuonAdam(
        [{"params": [stack], "optimizer": "Muon", "momentum": 0.95, "nesterov": True, "ns_steps": 5, "eps": 1e-7,
          "ns_coefficients": MUON_NS_COEFFICIENTS, "adjust_lr_fn": "original"}],
        lr=0.02,
        weight_decay=0.1,
    )  # fmt: skip
    ref_opt = torch.optim.Muon(ref, lr=0.02, weight_decay=0.1)
    for _ in range(2):
        grad = torch.randn(3, 8, 5, generator=g)
        stack.grad = grad.clone()
        for e in range(3):
            ref[e].grad = grad[e].clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(stack.detach(), torch.stack([r.detach() for r in ref]), rtol=0, atol=1e-6)


def test_newton_schulz_is_torchs():
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(12, 7)
    want = _zeropower_via_newtonschulz(g, MUON_NS_COEFFICIENTS, 5, 1e-7)
    assert torch.equal(compute_orthogonalized(g, MUON_NS_COEFFICIENTS, 5, 1e-7), want)


def test_state_round_trips():
    torch.manual_seed(0)
    model = Transformer(TINY)
    opt = build_optimizer([model], OptimizerConfig(name="Muon"))
    _steps([(model, [opt])], steps=1)
    twin = copy.deepcopy(model)
    opt2 = build_optimizer([twin], OptimizerConfig(name="Muon"))
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # load keeps the tensors it is given
    _steps([(model, [opt]), (twin, [opt2])], steps=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_bf16_states_keep_muon_momentum_in_fp32():
    from torchtitan.components.optim.muon import MuonLowPrecisionAdam

    torch.manual_seed(0)
    model = Transformer(TINY)
    ref = copy.deepcopy(model)
    opt = build_optimizer([model], OptimizerConfig(name="Muon", state_dtype="bfloat16"))
    ref_opt = build_optimizer([ref], OptimizerConfig(name="Muon"))
    assert isinstance(opt, MuonLowPrecisionAdam)
    _steps([(model, [opt]), (ref, [ref_opt])], steps=2)
    wq = model.layers["0"].attention.wq.weight
    assert opt.state[wq]["momentum_buffer"].dtype == torch.float32
    assert opt.state[model.norm.weight]["exp_avg"].dtype == torch.bfloat16
    # Bit-equal after 2 steps: the moments' bf16 rounding first shows in the second AdamW update, after the last
    # gradient was taken, so Muon saw the same gradients; a bf16 momentum would differ already.
    torch.testing.assert_close(wq, ref.layers["0"].attention.wq.weight, rtol=0, atol=0)
