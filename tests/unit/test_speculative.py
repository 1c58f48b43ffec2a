"""Speculative decoding with the MTP depths (components/generation/speculative.py): plain greedy decoding's tokens,
each draft the depths' full forward's, the accounting on accepted and rejected drafts, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import pytest
import torch

from torchtitan.checkpointing.common import save_model_weights
from torchtitan.components.generation import generate
from torchtitan.components.generation.speculative import check_speculative_settings, generate_speculative, mtp_depths
from torchtitan.distributed.init import init_model_weights
from torchtitan.models.deepseek_v3 import DeepSeekV3Transformer, deepseek_v3_configs
from torchtitan.models.llama.model import ModelArgs, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW = 20


def _model(mtp_layers: int, vocab: int = 64) -> DeepSeekV3Transformer:
    args = deepseek_v3_configs["debugmodel_tiny"]
    args = dataclasses.replace(args, vocab_size=vocab, max_seq_len=32, mtp_layers=mtp_layers)
    model = DeepSeekV3Transformer(args)
    init_model_weights(model, 0, torch.device("cpu"))
    return model.eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("depths", [1, 2])
def test_greedy_tokens_are_plain_decoding_s(depths):
    model, prompt = _model(depths), _prompt()
    out, stats = generate_speculative(model, prompt, NEW)
    assert torch.equal(out, generate(model, prompt, NEW))
    assert torch.equal(out, generate(model, prompt, NEW, use_cache=False))
    assert stats.generated == NEW and 0 <= stats.accepted <= stats.drafted and stats.drafted >= NEW // (depths + 1)
    assert model.mtp["0"].block.attention.sdpa.__class__.__name__ == "CausalAttention"  # the kernels are restored
    stop = int(out[0, 12])  # a step may check past it: the output ends at its first appearance
    first = 5 + int((out[0, 5:] == stop).nonzero()[0])
    assert torch.equal(generate_speculative(model, prompt, NEW, stop_token=[stop])[0], out[:, : first + 1])


def _full_forward_check(reference: DeepSeekV3Transformer, depth_normed: dict[int, torch.Tensor]):
    """edit_drafts that asserts each draft's logits are the depths' full forward's (no cache) at position L-1."""

    def check(tokens: torch.Tensor, drafts: torch.Tensor) -> None:
        seq = torch.cat([tokens[0], drafts[:-1]])[None]  # depth k reads the drafts of depths < k
        with torch.no_grad():
            full = reference(seq, mtp=True)  # (1, (1 + D) * len, vocab)
        n, last = seq.shape[1], tokens.shape[1] - 2  # position L-1
        for k in range(1, drafts.numel() + 1):
            want = full[0, k * n + last]
            torch.testing.assert_close(reference.output(depth_normed[k])[0], want, rtol=1e-5, atol=1e-5)
            assert int(want.argmax()) == int(drafts[k - 1])

    return check


@pytest.mark.parametrize("plan", ["right", "mixed"])
def test_drafts_and_accounting_on_accepted_and_rejected_drafts(plan):
    """Two depths; their drafts replaced with the model's own next tokens (all right), or in turn all right, the
    first right and the second wrong, all wrong: the depths' caches keep the full forward's drafts all along."""
    model, reference, prompt = _model(2), _model(2), _prompt()
    want = generate(reference, prompt, NEW)
    depth_normed: dict[int, torch.Tensor] = {}
    for k, depth in model.mtp.items():
        depth.norm.register_forward_hook(lambda _m, _a, out, k=int(k) + 1: depth_normed.__setitem__(k, out))
    check, steps = _full_forward_check(reference, depth_normed), []

    def edit(tokens: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        check(tokens, drafts)
        right = want[0, tokens.shape[1] : tokens.shape[1] + drafts.numel()]
        wrong = len(steps) % 3 if plan == "mixed" else 0  # 0: none wrong, 1: the second, 2: both
        edited = right.clone()
        edited[max(0, 2 - wrong) :] = (right[max(0, 2 - wrong) :] + 1) % 64  # another token: the model rejects it
        steps.append((drafts.numel(), int((edited == right).long().cumprod(0).sum())))
        return edited

    out, stats = generate_speculative(model, prompt, NEW, edit_drafts=edit)
    assert torch.equal(out, want)
    assert (stats.drafted, stats.accepted) == tuple(map(sum, zip(*steps)))
    if plan == "right":  # after the prompt's step, 3 tokens a step (2 drafts and the model's next); the last alone
        assert stats.acceptance == 1.0 and len(steps) == 6, steps
    else:
        assert {a for _, a in steps} == {0, 1, 2} and 0 < stats.acceptance < 1, steps


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match=r"--temperature 0.8 --top_k 0: speculative decoding is greedy only"):
        check_speculative_settings(temperature=0.8, top_k=0, use_cache=True, world_size=1)
    with pytest.raises(ValueError, match=r"--speculative mtp with --no_cache.*drop --no_cache"):
        check_speculative_settings(temperature=0.0, top_k=0, use_cache=False, world_size=1)
    with pytest.raises(NotImplementedError, match=r"on 2 ranks: not built"):
        check_speculative_settings(temperature=0.0, top_k=0, use_cache=True, world_size=2)
    llama = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, multiple_of=16, max_seq_len=16))
    with pytest.raises(
        ValueError, match=r"Transformer model: its family builds no .*allowed: a family whose model.mtp_layers"
    ):
        mtp_depths(llama)
    with pytest.raises(ValueError, match=r"no multi-token-prediction depths \(mtp_layers = 0.*--model.mtp_layers N"):
        mtp_depths(_model(0))
    with pytest.raises(ValueError, match=r"a batch of 2 prompts"):
        generate_speculative(_model(1), _prompt().expand(2, -1), 4)


def _script():
    spec = importlib.util.spec_from_file_location("generate_script", os.path.join(ROOT, "scripts", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_prints_plain_decoding_s_text_and_the_counts(tmp_path, capsys):
    """generate.py on a seed checkpoint of a DeepSeek-V3 with one depth (the shipped tokenizer's 2304 words)."""
    script, folders = _script(), {}
    for depths in (0, 1):
        model = _model(depths, vocab=2304)
        folders[depths] = str(tmp_path / f"mtp{depths}")
        info = {"name": "deepseek_v3", "flavor": "debugmodel_tiny", "args": dataclasses.asdict(model.args)}
        save_model_weights(model.state_dict(), folders[depths], info)
    argv = [folders[1], "--prompt", "def main(", "--max_new_tokens", "12"]
    assert script.main(argv) == 0
    plain = capsys.readouterr().out
    assert script.main([*argv, "--speculative", "mtp"]) == 0
    text, line = capsys.readouterr().out.rsplit("\n", 2)[:2]
    assert text + "\n" == plain
    assert re.fullmatch(
        r"speculative mtp: 12 tokens, \d+ drafted, \d+ accepted \(acceptance [01]\.\d\d\), [\d.]+ tokens/s", line
    )
    for extra in (["--temperature", "0.8"], ["--no_cache"]):
        assert script.main([*argv, "--speculative", "mtp", *extra]) == 2
    assert script.main([folders[0], *argv[1:], "--speculative", "mtp"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(e.startswith("error: --speculative mtp") for e in err), err


def test_deepseek_v32_depths_draft_through_their_sparse_attention_cache():
    """V3.2's depths are DSA blocks: their cached kernel (the indexer's keys kept) serves the draft and the check;
    past index_topk tokens (4 here), so the selection is in play. 16 indexer heads: exact ties are rare."""
    from torchtitan.models.deepseek_v32 import DeepSeekV32Transformer, deepseek_v32_configs

    args = dataclasses.replace(
        deepseek_v32_configs["debugmodel_tiny"], vocab_size=64, max_seq_len=32, mtp_layers=1, index_topk=4
    )
    model = DeepSeekV32Transformer(dataclasses.replace(args, index_n_heads=16))
    init_model_weights(model, 0, torch.device("cpu"))
    model.eval()
    out, stats = generate_speculative(model, _prompt(), NEW)
    assert torch.equal(out, generate(model, _prompt(), NEW)) and stats.drafted > 0
    assert torch.equal(out, generate(model, _prompt(), NEW, use_cache=False))
