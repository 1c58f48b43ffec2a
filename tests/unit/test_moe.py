"""The MoE model (models/moe): shapes, router, grouped-mm vs loop, load balancing, init, purity, errors."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

from torchtitan.distributed.init import init_model_weights
from torchtitan.models.moe import MoE, MoEArgs, MoETransformer, TokenChoiceRouter, num_active_params
from torchtitan.models.moe.moe import compute_aux_loss
from torchtitan.spec import get_model_spec

TINY = MoEArgs(
    dim=32,
    n_layers=3,
    n_heads=4,
    vocab_size=64,
    multiple_of=16,
    max_seq_len=16,
    num_experts=4,
    top_k=2,
    moe_hidden_dim=16,
    num_shared_experts=1,
    first_k_dense=1,
)


def _model(args=TINY, seed=0):
    with torch.device("meta"):
        model = MoETransformer(args)
    model.to_empty(device="cpu")
    init_model_weights(model, seed, torch.device("cpu"))
    return model


def _layer(args=TINY, seed=0):
    torch.manual_seed(seed)
    moe = MoE(args)
    moe.init_weights(0.02)
    return moe


def test_shapes_layers_and_expert_load():
    model = _model()
    assert [type(b.feed_forward).__name__ for b in model.layers.values()] == ["FeedForward", "MoE", "MoE"]
    tokens = torch.randint(0, 64, (2, 8))
    assert model(tokens).shape == (2, 8, 64)
    load = model.expert_load()
    assert list(load) == ["1", "2"]
    assert all(c.shape == (4,) and c.sum() == 2 * 8 * TINY.top_k for c in load.values())
    moe = model.layers["1"].feed_forward
    assert moe.experts.w1.shape == (4, 16, 32) and moe.experts.w2.shape == (4, 32, 16)
    assert moe.shared_expert.w1.weight.shape == (16, 32)


def test_interleave_and_registry():
    args = dataclasses.replace(TINY, n_layers=6, first_k_dense=2, moe_every=2)
    assert [i for i in range(6) if args.is_moe_layer(i)] == [2, 4]
    assert get_model_spec("llama3_moe").model_cls is MoETransformer
    debug = get_model_spec("llama3_moe").flavors["debugmodel"]
    assert (debug.dim, debug.n_layers, debug.num_experts, debug.top_k, debug.load_balance) == (256, 8, 8, 2, "bias")


@pytest.mark.parametrize("dim, hidden", [(32, 16), (256, 256), (4096, 1408), (7168, 2048), (100, 7)])
def test_shared_expert_width_is_exact(dim, hidden):
    args = dataclasses.replace(TINY, dim=dim, n_heads=1, moe_hidden_dim=hidden)
    with torch.device("meta"):
        assert MoE(args).shared_expert.w1.weight.shape == (hidden, dim)


def test_num_active_params_counts_top_k_of_the_routed_experts():
    model = _model()
    non_embed = sum(p.numel() for p in model.parameters()) - 64 * 32
    routed_per_layer = 3 * 4 * 16 * 32
    assert num_active_params(TINY) == non_embed - 2 * routed_per_layer * (4 - 2) // 4


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_loop_exactly(dtype):
    gmm, loop = _layer(), _layer()
    loop.experts.use_grouped_mm = False
    gmm.to(dtype), loop.to(dtype)
    x = torch.randn(3, 7, 32, dtype=dtype)
    target = torch.randn(3, 7, 32, dtype=dtype)
    outs = []
    for moe in (gmm, loop):
        out = moe(x)
        ((out.float() - target.float()) ** 2).mean().backward()
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    g1, g2 = _grads(gmm), _grads(loop)
    assert all(torch.equal(g1[n], g2[n]) for n in g1), [n for n in g1 if not torch.equal(g1[n], g2[n])]


def test_zero_token_experts_get_zero_grads():
    for use_gmm in (True, False):
        moe = _layer(dataclasses.replace(TINY, load_balance="bias", use_grouped_mm=use_gmm))
        moe.expert_bias.copy_(torch.tensor([0.0, 10.0, 0.0, 10.0]))  # every token picks experts 1 and 3
        moe(torch.randn(2, 5, 32)).pow(2).mean().backward()
        assert moe.tokens_per_expert.tolist() == [0.0, 10.0, 0.0, 10.0]
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            assert w.grad is not None
            assert w.grad[[0, 2]].abs().sum() == 0 and (w.grad[[1, 3]].abs().sum(dim=(1, 2)) > 0).all()


def test_router_softmax_top_k_and_bias_selects_only():
    router = TokenChoiceRouter(dim=8, num_experts=4, top_k=2, score_func="softmax", route_norm=False)
    router.gate.weight.data = torch.eye(4, 8)
    x = torch.zeros(1, 8)
    x[0, :4] = torch.tensor([0.0, 3.0, 1.0, 2.0])  # logits = x[:4]
    weights, experts, scores = router(x)
    assert torch.allclose(scores, torch.softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), -1))
    assert experts.tolist() == [[1, 3]] and torch.equal(weights, scores[:, [1, 3]])
    weights, experts, _ = router(x, expert_bias=torch.tensor([5.0, 0.0, 0.0, 0.0]))
    assert experts.tolist() == [[0, 1]] and torch.equal(weights, scores[:, [0, 1]])  # unbiased weights


def test_router_sigmoid_and_route_norm():
    router = TokenChoiceRouter(dim=4, num_experts=4, top_k=2, score_func="sigmoid", route_norm=True)
    router.gate.weight.data = torch.eye(4)
    x = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    weights, experts, scores = router(x)
    assert torch.allclose(scores, torch.sigmoid(x))
    assert experts.tolist() == [[2, 0]]
    expected = torch.sigmoid(x[:, [2, 0]])
    assert torch.allclose(weights, expected / expected.sum(), atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(1))


def test_aux_loss_on_hand_made_routing():
    # 2 tokens, 2 experts, top-1. Probabilities [[.75, .25], [.75, .25]], both tokens on expert 0:
    # f = [1, 0], P = [.75, .25] -> E * sum f P = 2 * .75.
    scores = torch.tensor([[0.75, 0.25], [0.75, 0.25]])
    assert torch.isclose(compute_aux_loss(scores, torch.tensor([2, 0]), top_k=1), torch.tensor(1.5))
    balanced = torch.full((4, 4), 0.25)
    assert torch.isclose(compute_aux_loss(balanced, torch.tensor([2, 2, 2, 2]), top_k=2), torch.tensor(1.0))
    # sigmoid scores are row-normalised first: [[3, 1]] -> [.75, .25]
    assert torch.isclose(compute_aux_loss(torch.tensor([[0.6, 0.2]]), torch.tensor([1, 0]), top_k=1), torch.tensor(1.5))


def test_model_aux_loss_is_differentiable_and_weighted():
    model = _model(dataclasses.replace(TINY, load_balance="aux_loss", aux_loss_coeff=0.5))
    model(torch.randint(0, 64, (2, 8)))
    aux = model.aux_loss()
    assert 2 * 0.5 <= aux.item() <= 2 * 0.5 * 4  # 2 layers, each coeff * [1, E]
    aux.backward()
    assert model.layers["1"].feed_forward.router.gate.weight.grad.abs().sum() > 0
    assert _model(dataclasses.replace(TINY, load_balance="bias")).aux_loss().item() == 0.0


def test_bias_update_direction_and_reduce_hook():
    model = _model(dataclasses.replace(TINY, load_balance="bias", bias_update_rate=0.1))
    counts = {"1": torch.tensor([10.0, 0.0, 3.0, 3.0]), "2": torch.tensor([4.0, 4.0, 4.0, 4.0])}
    calls = []

    def reduce_fn(stacked):  # stands in for an all-reduce over the data-parallel ranks
        calls.append(stacked.shape)
        return stacked * 2

    model.update_expert_bias(counts, reduce_fn)
    assert calls == [(2, 4)]
    assert model.layers["1"].feed_forward.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    assert model.layers["2"].feed_forward.expert_bias.tolist() == [0.0, 0.0, 0.0, 0.0]
    # checkpointed with the model; the per-forward counts are not
    keys = model.state_dict().keys()
    assert "layers.1.feed_forward.expert_bias" in keys and "layers.1.feed_forward.tokens_per_expert" not in keys


def test_init_is_seeded_and_zeroes_buffers():
    args = dataclasses.replace(TINY, load_balance="bias")
    a, b = _model(args), _model(args)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    moe = a.layers["2"].feed_forward
    assert moe.expert_bias.abs().sum() == 0 and moe.tokens_per_expert.abs().sum() == 0
    assert 0.015 < moe.experts.w1.std() < 0.025  # llama FFN's w1 std
    units = [name for name, _ in a.init_units()]
    assert units == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("top_k", 5, ["MoEArgs.top_k = 5", "num_experts = 4", "top_k <= num_experts"]),
        ("score_func", "tanh", ["MoEArgs.score_func = 'tanh'", "softmax", "sigmoid"]),
        ("load_balance", "loss", ["MoEArgs.load_balance = 'loss'", "aux_loss"]),
        ("num_shared_experts", 2, ["MoEArgs.num_shared_experts = 2", "0 and 1"]),
    ],
)
def test_bad_args_raise_value_error(field, value, words):
    with pytest.raises(ValueError) as err:
        dataclasses.replace(TINY, **{field: value})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_models_moe_is_pure():
    root = pathlib.Path(__file__).resolve().parents[2] / "torchtitan" / "models" / "moe"
    banned = re.compile(r"torch\.distributed|os\.environ|\.cuda\(")
    hits = [
        f"{p.name}:{i}"
        for p in root.glob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert list(root.glob("*.py")) and hits == []


def test_moe_tp_plan_keeps_dense_ffn_entries_off_moe_blocks():
    from torchtitan.distributed.tensor_parallel.plan import TokenShardedReplicate, block_plan, moe_block_plan

    plan = moe_block_plan(has_shared_expert=True)
    assert not any(k.startswith("feed_forward.w") for k in plan)
    attention = {k for k in block_plan() if not k.startswith("feed_forward")}
    assert attention <= set(plan)  # llama's attention plan unchanged
    assert isinstance(plan["feed_forward.router.gate"], TokenShardedReplicate)
    assert isinstance(plan["feed_forward.shared_expert"], TokenShardedReplicate)
    assert "feed_forward.shared_expert" not in moe_block_plan(has_shared_expert=False)


def test_expert_load_metrics():
    from torchtitan.features.moe_balance.load_balancing import compute_load_metrics

    out = compute_load_metrics({"layers.1": [2.0, 2.0, 2.0, 2.0], "layers.2": [8.0, 0.0, 0.0, 0.0]})
    assert out["expert_imbalance"] == {"layers.1": 1.0, "layers.2": 4.0}
    assert out["expert_imbalance_max"] == 4.0
    assert out["expert_load"]["layers.2"] == [8.0, 0.0, 0.0, 0.0]


def test_debugmodel_aux_loss_flavor():
    args = get_model_spec("llama3_moe").flavors["debugmodel_aux_loss"]
    assert (args.load_balance, args.score_func, args.num_experts) == ("aux_loss", "softmax", 8)


def test_aux_loss_over_one_rank_equals_the_local_loss():
    """A stats sum over one rank (the identity) gives the per-rank form's loss and gradient."""
    torch.manual_seed(0)
    logits = torch.randn(12, 4, requires_grad=True)
    counts = torch.bincount(logits.detach().topk(2).indices.flatten(), minlength=4)
    losses = [compute_aux_loss(logits.softmax(-1), counts, 2, stats_sum) for stats_sum in (None, lambda s: s)]
    grads = [torch.autograd.grad(loss, logits)[0] for loss in losses]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-9)


def test_aux_loss_scope_key_and_its_no_effect_warning():
    from torchtitan.config.manager import JobConfig, format_help
    from torchtitan.preflight import run_preflight

    assert "training.moe_aux_loss_scope" in format_help() and "global_micro_batch" in format_help()
    local = ["--training.moe_aux_loss_scope", "local_micro_batch"]
    aux = ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel_aux_loss"]
    assert not any("moe_aux_loss_scope" in w for w in run_preflight(JobConfig.parse_args([*aux, *local]), 1))
    for model in (["--model.name", "llama3"], ["--model.name", "llama3_moe"]):  # dense; expert-bias balanced
        warnings = run_preflight(JobConfig.parse_args([*model, *local]), 1)
        assert any("training.moe_aux_loss_scope = 'local_micro_batch' has no effect" in w for w in warnings)
    with pytest.raises(ValueError, match="moe_aux_loss_scope"):
        JobConfig.parse_args(["--training.moe_aux_loss_scope", "rank"])
