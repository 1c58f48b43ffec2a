"""Generation with the KV cache for the frontier families: multi-head latent attention (deepseek_v3: v heads
narrower than q/k), attention sinks with a sliding window (gpt_oss), and the hybrids' recurrent layers (qwen3_5 and
qwen3_5_moe: each Gated DeltaNet layer's convolution inputs and state carried between calls; the prompt shorter than
a chunk runs the token-by-token rule, the full forward the chunked one). Each cached decoding step's logits equal a
full forward over the whole sequence (fp32), past the window's length."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.components.generation import KVCache
from torchtitan.spec import get_model_spec

VOCAB, PROMPT, STEPS = 256, 24, 24


def _model(name: str) -> torch.nn.Module:
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=VOCAB, max_seq_len=PROMPT + STEPS)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    with torch.no_grad():  # larger weights (and sinks): attention far from uniform
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "qwen3_5", "qwen3_5_moe"])
@torch.no_grad()
def test_cached_decoding_equals_a_full_forward(name):
    model = _model(name)
    if name == "gpt_oss":  # the window must be shorter than the sequence for the test to mean anything
        windows = {block.attention.sdpa.window for block in model.layers.values()}
        assert None in windows and any(w is not None and w < PROMPT + STEPS for w in windows), windows
    tokens = torch.randint(0, VOCAB, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))
    full = model(tokens)  # (2, seqlen, vocab)
    cache = KVCache(PROMPT + STEPS)
    swapped = cache.install(model)
    try:
        cached = [model(tokens[:, :PROMPT])]
        cache.length = PROMPT
        for t in range(PROMPT, PROMPT + STEPS):
            cached.append(model(tokens[:, t : t + 1], torch.arange(t, t + 1)))
            cache.length = t + 1
    finally:
        KVCache.uninstall(swapped)
    delta = (torch.cat(cached, dim=1) - full).abs().max().item()
    print(f"{name}: max |dlogits| cached vs full {delta:.1e}")
    assert delta <= 1e-4, delta
