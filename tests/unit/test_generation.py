"""Generation (components/generation/): the KV cache changes nothing but the cost."""

from __future__ import annotations

import pytest
import torch

from torchtitan.components.generation import Sampling, generate
from torchtitan.distributed.init import init_model_weights
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.qwen3 import Qwen3Args, Qwen3Transformer

LLAMA = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, multiple_of=32, max_seq_len=64)
QWEN3 = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, vocab_size=97, max_seq_len=64)


def _model(cls, args):
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    init_model_weights(model, 0, torch.device("cpu"))
    return model.eval()


@pytest.mark.parametrize("cls, args", [(Transformer, LLAMA), (Qwen3Transformer, QWEN3)], ids=["llama3", "qwen3"])
def test_greedy_with_the_cache_equals_full_forwards(cls, args):
    model = _model(cls, args)
    prompt = torch.randint(0, args.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    cached = generate(model, prompt, 20)
    full = generate(model, prompt, 20, use_cache=False)
    assert cached.shape == (3, 27) and torch.equal(cached[:, :7], prompt)
    assert torch.equal(cached, full), (cached, full)
    assert model.layers["0"].attention.sdpa.__class__.__name__ == "CausalAttention"  # the kernel is restored


def test_sampling_is_seeded_and_top_k_limits_the_choice():
    model = _model(Transformer, LLAMA)
    prompt = torch.zeros(2, 3, dtype=torch.long)
    sample = Sampling(temperature=1.0, top_k=5)
    a = generate(model, prompt, 10, sample, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 10, sample, generator=torch.Generator().manual_seed(1))
    c = generate(model, prompt, 10, sample, use_cache=False, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and torch.equal(a, c)
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    picks = {int(Sampling(temperature=1.0, top_k=2).pick(logits, torch.Generator().manual_seed(s))) for s in range(50)}
    assert picks == {1, 2}


def test_a_stop_token_ends_generation():
    model = _model(Transformer, LLAMA)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    first = int(generate(model, prompt, 1)[0, -1])
    assert generate(model, prompt, 10, stop_token=first).shape == (1, 4)


def test_any_of_several_stop_tokens_ends_generation():
    model = _model(Transformer, LLAMA)
    prompt = torch.tensor([[0, 0, 0], [5, 6, 7]])
    free = generate(model, prompt, 10)  # (2, 13)
    first, second = int(free[0, 3]), int(free[1, 3])  # each row's first generated token
    other = next(t for t in range(LLAMA.vocab_size) if t not in free[:, 3:])  # never generated
    # the second id of the set stops the first row, as the first id would
    assert generate(model, prompt[:1], 10, stop_token=(other, first)).shape == (1, 4)
    assert generate(model, prompt[:1], 10, stop_token=[first]).shape == (1, 4)
    # a batch stops once every row has produced one of them, each its own
    assert torch.equal(generate(model, prompt, 10, stop_token={first, second}), free[:, :4])
    # ids that never come: the full length, as without stops
    assert torch.equal(generate(model, prompt, 10, stop_token=(other,)), free)
    assert torch.equal(generate(model, prompt, 10, stop_token=()), free)
