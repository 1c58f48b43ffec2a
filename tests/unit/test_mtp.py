"""Multi-token prediction (model.mtp_layers): the depths' math, the init that leaves the model's unchanged, lambda = 0
bit for bit, the published layout round trip, the depth's tensor-parallel plan, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.support.mtp import write_mtp_folder
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.hf.convert import check_hf_matches, export_to_hf, import_from_hf
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.init import init_model_weights
from torchtitan.distributed.pipeline.stages import prune_to_stage
from torchtitan.features.mtp.step import MtpLoss
from torchtitan.models.common.documents import IGNORE_INDEX
from torchtitan.models.common.mtp import mtp_labels
from torchtitan.models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_configs
from torchtitan.preflight import run_preflight
from torchtitan.spec import flavor_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 16


def _model(mtp_layers: int, seed: int = 0) -> DeepSeekV3Transformer:
    args = dataclasses.replace(deepseek_v3_configs["debugmodel_tiny"], vocab_size=64, max_seq_len=32)
    model = DeepSeekV3Transformer(dataclasses.replace(args, mtp_layers=mtp_layers))
    init_model_weights(model, seed, torch.device("cpu"))
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))


def test_depths_leave_the_model_init_and_logits_unchanged():
    plain, with_mtp = _model(0), _model(2)
    ours = with_mtp.state_dict()
    assert all(torch.equal(w, ours[k]) for k, w in plain.state_dict().items())
    assert sorted({k.split(".")[1] for k in ours if k.startswith("mtp.")}) == ["0", "1"]
    x = _tokens()[:, :-1]
    assert torch.equal(plain(x), with_mtp(x))
    assert with_mtp(x, mtp=True).shape == (2, 3 * SEQ, 64)
    assert list(with_mtp.moe_layers())[-2:] == ["4", "5"]  # the depths' MoE as published layers n_layers + k


def test_depth_one_is_the_report_module_by_hand():
    """logits of depth 1 at position i = head(norm(block(eh_proj([enorm(emb(t_{i+1})), hnorm(h_i)])))), h the model's
    final-normed hidden state; the rolled tail never reaches an earlier position (causal)."""
    model = _model(1).eval()
    x = _tokens()[:, :-1]
    with torch.no_grad():
        got = model(x, mtp=True)[:, SEQ:]  # (bs, seqlen, vocab): depth 1
        h = model(x, return_hidden=True)[:, :-1]
        depth = model.mtp["0"]
        e = model.tok_embeddings(x[:, 1:])
        mixed = depth.eh_proj(torch.cat([depth.enorm(e), depth.hnorm(h)], dim=-1))
        want = model.output(depth.norm(depth.block(mixed, model.rope_at(None))))
    torch.testing.assert_close(got[:, :-1], want, rtol=1e-5, atol=1e-6)


def test_pipeline_stages_hand_the_embedded_tokens_ahead_to_the_depths_on_the_last():
    """Pruned to two stages (distributed/pipeline/stages.py ``prune_to_stage``), the first embeds the tokens ahead and
    hands them on beside its hidden state, the depths only on the last: the whole model's logits and gradients
    (the one embedding table's included) bit for bit; validation's forwards hand on the hidden state alone."""
    whole, first, last = _model(2), _model(2), _model(2)
    prune_to_stage(first, 0, 2, True, False)
    prune_to_stage(last, 2, whole.args.n_layers, False, True)
    assert first.mtp is None and last.mtp is not None and last.tok_embeddings is None
    x = _tokens()[:, :-1]
    want = whole(x, mtp=True)
    sent = first(x, mtp=True)  # (hidden, *ahead): each (bs, seqlen, dim)
    received = [t.detach().requires_grad_() for t in sent]  # as the schedule receives them
    got = last(*received, mtp=True)
    assert len(sent) == 3 and torch.equal(got, want)
    want.square().mean().backward()
    got.square().mean().backward()
    torch.autograd.backward(list(sent), [t.grad for t in received])  # the schedule's backward send
    grads = {k: p.grad for part in (first, last) for k, p in part.named_parameters()}
    assert grads.keys() == dict(whole.named_parameters()).keys()
    assert all(torch.equal(grads[k], p.grad) for k, p in whole.named_parameters()), "gradients differ"
    assert isinstance(first(x), torch.Tensor)  # validation: no depths, nothing ahead


def test_mtp_labels_predict_token_i_plus_k_plus_one_within_a_chain():
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 4, 5, 6]])
    assert mtp_labels(labels, 1).tolist() == [[2, IGNORE_INDEX, IGNORE_INDEX, 5, 6, IGNORE_INDEX]]
    assert mtp_labels(labels, 2).tolist() == [[IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 6] + [IGNORE_INDEX] * 2]


def _grads(model, loss_fn, *, mtp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    t = _tokens()
    loss = loss_fn(model(t[:, :-1], mtp=mtp), t[:, 1:])
    aux = loss_fn.aux_loss(model, 1.0) if isinstance(loss_fn, MtpLoss) else None
    torch.autograd.backward([loss] if aux is None else [loss, aux])
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


def test_weight_zero_is_the_run_without_mtp_bit_for_bit():
    want_loss, want = _grads(_model(0), cross_entropy_loss, mtp=False)
    world = type("World", (), {"group": lambda self, name: None})()
    mtp_loss = MtpLoss(cross_entropy_loss, depths=1, weight=0.0, world=world, device=torch.device("cpu"))
    got_loss, got = _grads(_model(1), mtp_loss, mtp=True)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(got[k], g) for k, g in want.items())
    assert all(g.abs().sum() == 0 for k, g in got.items() if k.startswith("mtp."))
    mtp_loss.reduce_step(keep_metrics=True, outer_sum=None)
    fields, scalars = mtp_loss.metrics()
    assert (
        len(fields["mtp_loss"]) == 1 and 3.5 < fields["mtp_loss"][0] < 5 and "loss_metrics/mtp_loss_depth_1" in scalars
    )
    weighted = MtpLoss(cross_entropy_loss, depths=1, weight=0.3, world=world, device=torch.device("cpu"))
    _, moved = _grads(_model(1), weighted, mtp=True)
    assert not torch.equal(moved["layers.0.attention.wo.weight"], want["layers.0.attention.wo.weight"])


def test_published_mtp_folder_round_trips_bit_for_bit(tmp_path):
    pytest.importorskip("transformers")
    hf_dir = write_mtp_folder(str(tmp_path / "hf_in"))
    seed = str(tmp_path / "seed" / "step-0")
    import_from_hf(hf_dir, seed, model_name="deepseek_v3")
    weights, _ = load_model_weights(seed)
    assert {k.split(".")[2] for k in weights if k.startswith("mtp.0.")} >= {
        "enorm",
        "hnorm",
        "eh_proj",
        "norm",
        "block",
    }
    out = str(tmp_path / "hf_out")
    export_to_hf(seed, out)
    want, got = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1


def _config(*args: str) -> JobConfig:
    dsv3 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_tiny"]
    return JobConfig.parse_args(
        ["--job.config_file", os.path.join(ROOT, "train_configs/debug_model.toml"), *dsv3, *args]
    )


def test_bad_inputs_end_in_one_line(tmp_path):
    assert run_preflight(_config("--model.mtp_layers", "1"), 1, this_machine=False) == []
    llama = JobConfig.parse_args(
        ["--job.config_file", os.path.join(ROOT, "train_configs/debug_model.toml"), "--model.mtp_layers", "1"]
    )
    with pytest.raises(ConfigError, match=r"model.mtp_layers = 1 with model.name = 'llama3'.*deepseek_v3.*set model"):
        run_preflight(llama, 1, this_machine=False)
    v4 = _config("--model.name", "deepseek_v4", "--model.mtp_layers", "1")  # builds no depths
    with pytest.raises(
        ConfigError, match=r"model.name = 'deepseek_v4': this family has no multi-token.*\(deepseek_v3, deepseek_v32\)"
    ):
        run_preflight(v4, 1, this_machine=False)
    v32 = _config("--model.name", "deepseek_v32", "--model.mtp_layers", "1", "--model.dsa_stage", "dense_warmup")
    assert run_preflight(v32, 1, this_machine=False) == []
    assert (flavor_args(v32.model).mtp_layers, flavor_args(v32.model).dsa_stage) == (1, "dense_warmup")  # both keys
    tp = ["--training.tensor_parallel_degree", "2", "--experimental.expert_parallel_degree", "2"]
    assert run_preflight(_config("--model.mtp_layers", "1", *tp), 2, this_machine=False) == []  # built
    pp = ["--experimental.pipeline_parallel_degree", "2"]
    assert run_preflight(_config("--model.mtp_layers", "1", *pp), 2, this_machine=False) == []  # built
    for setting, world in (
        (["--experimental.context_parallel_degree", "2"], 2),
        (["--training.loss_chunk_size", "8"], 1),
    ):
        key = setting[0].removeprefix("--")
        with pytest.raises(NotImplementedError, match=rf"model.mtp_layers = 1 with {key} = .*not built"):
            run_preflight(_config("--model.mtp_layers", "1", *setting), world, this_machine=False)
    pytest.importorskip("transformers")
    hf_dir = write_mtp_folder(str(tmp_path / "hf_in"))
    args = dataclasses.asdict(dataclasses.replace(deepseek_v3_configs["debugmodel_tiny"], vocab_size=256))
    check_hf_matches(hf_dir, "deepseek_v3", {**args, "mtp_layers": 1})
    check_hf_matches(hf_dir, "deepseek_v3", args)  # fewer depths than the folder: its layer is not read
    with pytest.raises(ValueError, match=r"model.mtp_layers = 2 .* holds 1 .*allowed: 0..1; set model.mtp_layers <= 1"):
        check_hf_matches(hf_dir, "deepseek_v3", {**args, "mtp_layers": 2})


def test_deepseek_v32_depths_are_dsa_blocks_whose_indexers_train_and_export_under_the_published_names():
    from torchtitan.models.deepseek_v32 import DeepSeekV32Transformer, deepseek_v32_configs
    from torchtitan.models.deepseek_v32.hf_adapter import ADAPTER
    from torchtitan.models.deepseek_v32.indexer import SparseAttention

    args = dataclasses.replace(
        deepseek_v32_configs["debugmodel_tiny"], vocab_size=64, max_seq_len=32, index_topk=4, mtp_layers=1
    )
    model = DeepSeekV32Transformer(args)
    init_model_weights(model, 0, torch.device("cpu"))
    plain = DeepSeekV32Transformer(dataclasses.replace(args, mtp_layers=0))
    init_model_weights(plain, 0, torch.device("cpu"))
    x = _tokens()[:, :-1]
    assert torch.equal(plain(x), model(x))  # the depth leaves the model's init and logits unchanged
    assert model(x, mtp=True).shape == (2, 2 * SEQ, 64)
    depth_kernel = model.mtp["0"].block.attention.sdpa
    assert isinstance(depth_kernel, SparseAttention) and depth_kernel.indexer_loss is not None  # its indexer ran
    layer_terms = [m.attention.sdpa.indexer_loss for m in model.layers.values()]
    want = args.indexer_loss_coeff * torch.stack([*layer_terms, depth_kernel.indexer_loss]).sum()
    torch.testing.assert_close(model.indexer_loss(), want, rtol=0, atol=0)  # the depth's indexer loss counts
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    hf = ADAPTER.to_hf_state_dict(sd, dataclasses.asdict(args))
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.self_attn.indexer.wk.weight"} <= hf.keys()
    back = ADAPTER.from_hf_state_dict(hf, dataclasses.asdict(args))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    config = ADAPTER.hf_config(dataclasses.asdict(args), hf, torch.float32)
    assert config["num_nextn_predict_layers"] == 1 and ADAPTER.model_args_from_hf(config)["mtp_layers"] == 1


def test_depth_tp_plan_covers_the_depth_outside_its_block():
    """Every parameter of a depth outside its block (which takes the blocks' plan) has a style: one left out
    would stay a plain tensor beside DTensors."""
    from torchtitan.distributed.tensor_parallel.plan import mtp_depth_plan

    depth = _model(1).mtp["0"]
    own = {name.rsplit(".", 1)[0] for name, _ in depth.named_parameters() if not name.startswith("block.")}
    assert set(mtp_depth_plan()) == own == {"enorm", "hnorm", "eh_proj", "norm"}
