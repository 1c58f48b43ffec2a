import dataclasses
import pathlib
import re

import pytest
import torch

from torchtitan.distributed.init import init_model_weights
from torchtitan.models import ModelArgs, Transformer
from torchtitan.models.llama import llama3_configs
from torchtitan.models.llama.model import build_norm, ffn_hidden_dim

TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=32)


def _build(args=TINY, seed=0):
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    init_model_weights(model, seed, torch.device("cpu"))
    return model


# Meta's model cards / the HF checkpoints' parameter counts (Llama 3.2 1B and 3B count the tied table once)
PUBLISHED = {
    "1B": 1_235_814_400,
    "3B": 3_212_749_824,
    "8B": 8_030_261_248,
    "70B": 70_553_706_496,
    "405B": 405_853_388_800,
}


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_flavor_sizes_on_meta(flavor):
    with torch.device("meta"):
        model = Transformer(llama3_configs[flavor])
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[flavor]
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor in ("1B", "3B"))


def test_tied_head_survives_materialisation_and_init():
    """``to_empty`` unties a shared parameter; ``init_buffers`` (run by the init) ties it again."""
    model = _build(dataclasses.replace(TINY, tie_word_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(list(_build().parameters())) - 1
    std = model.tok_embeddings.weight.std().item()
    assert abs(std - TINY.dim**-0.5) < 0.2 * TINY.dim**-0.5  # initialised as a head, not N(0, 1)


def test_flop_params_count_a_tied_table_once_for_the_head():
    from torchtitan.spec import count_non_embedding_params

    untied, tied = _build(), _build(dataclasses.replace(TINY, tie_word_embeddings=True))
    embedding = TINY.vocab_size * TINY.dim
    # untied: every parameter but the embedding; tied: the head's matmul uses the one table
    assert count_non_embedding_params(TINY, untied) == sum(p.numel() for p in untied.parameters()) - embedding
    assert count_non_embedding_params(TINY, tied) == count_non_embedding_params(TINY, untied)


def test_8b_ffn_width_matches_published():
    assert ffn_hidden_dim(llama3_configs["8B"]) == 14336
    assert ffn_hidden_dim(llama3_configs["70B"]) == 28672
    assert ffn_hidden_dim(llama3_configs["405B"]) == 53248


def test_forward_shapes_and_gqa():
    model = _build()
    tokens = torch.randint(0, TINY.vocab_size, (3, 16))
    assert model(tokens).shape == (3, 16, TINY.vocab_size)
    assert model.layers["0"].attention.wk.weight.shape == (2 * 16, 64)


def test_explicit_positions_equal_default():
    model = _build()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    torch.testing.assert_close(model(tokens), model(tokens, positions=torch.arange(16)), rtol=0, atol=0)


def test_causal_prefix_invariance():
    # A causal model's logits for a prefix do not depend on later tokens.
    model = _build()
    tokens = torch.randint(0, TINY.vocab_size, (1, 16))
    torch.testing.assert_close(model(tokens)[:, :8], model(tokens[:, :8]), rtol=1e-5, atol=1e-5)


def test_init_depends_only_on_seed_and_is_per_unit():
    a, b, c = _build(seed=1), _build(seed=1), _build(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    # A model without the embedding (a later pipeline stage) draws the same block weights.
    with torch.device("meta"):
        stage = Transformer(TINY)
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    init_model_weights(stage, 1, torch.device("cpu"))
    torch.testing.assert_close(stage.layers["1"].attention.wq.weight, a.layers["1"].attention.wq.weight, rtol=0, atol=0)


def test_init_statistics():
    model = _build(dataclasses.replace(TINY, dim=128, n_heads=4, n_kv_heads=4))
    assert abs(model.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.003
    assert torch.all(model.norm.weight == 1)
    std = 128**-0.5
    assert model.output.weight.abs().max().item() <= 3 * std + 1e-6


def test_norm_types():
    for norm in ("rmsnorm", "layernorm", "np_layernorm"):
        model = _build(dataclasses.replace(TINY, norm_type=norm))
        assert torch.isfinite(model(torch.zeros(1, 4, dtype=torch.long))).all()


def test_models_import_nothing_distributed():
    root = pathlib.Path(__file__).resolve().parents[2] / "torchtitan" / "models"
    offenders = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        if re.search(r"torch\.distributed|os\.environ|\.cuda\(|import os\b", text):
            offenders.append(str(path))
        # a family's spec.py wires it to the trainer: it may import torchtitan.spec and the config's errors
        if path.name != "spec.py" and re.search(r"from torchtitan\.(?!models)", text):
            offenders.append(str(path))
    assert offenders == []


def test_fused_rmsnorm_is_the_same_module_and_kernel():
    """torch 2.13's nn.RMSNorm runs aten::_fused_rms_norm, so fused_rmsnorm builds the same module."""
    fused, plain = build_norm("fused_rmsnorm", 16, 1e-5), build_norm("rmsnorm", 16, 1e-5)
    assert type(fused) is type(plain) is torch.nn.RMSNorm and fused.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 3, 16)
    with torch.profiler.profile() as prof:
        fused(x)
    assert "aten::_fused_rms_norm" in {e.name for e in prof.events()}
