"""The indexed loader and blends, in process: global batch k is a function of k only (layout, accumulation and
resume under another data-parallel degree change nothing), Megatron's rule keeps every running share within one
sample of its weight, a changed mix is refused on resume unless training.dataset_mix_restart says otherwise."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tests.support.indexed import TOKENIZER, write_jsonl
from torchtitan.config.errors import ConfigError
from torchtitan.config.mix import parse_mix
from torchtitan.datasets.hf_datasets import compute_stream_groups, merge_data_states
from torchtitan.datasets.indexed.blend import BlendRule
from torchtitan.datasets.indexed.tokenize import tokenize_to_indexed
from torchtitan.datasets.text_loader import build_text_data_loader

SEQ = 32
GLOBAL = 8  # samples per step


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """Three indexed sources of different sizes (the smallest wraps around within a few steps) and a jsonl."""
    folder = tmp_path_factory.mktemp("blend")
    out = {}
    for name, n, word in (("web", 120, "web page"), ("code", 40, "def code():"), ("math", 5, "1 + 2 = 3")):
        jsonl = write_jsonl(folder / f"{name}.jsonl", [f"{word} {i} " * (3 + i % 5) for i in range(n)])
        tokenize_to_indexed(jsonl, str(folder / name), TOKENIZER, progress=io.StringIO())
        out[name], out[name + "_jsonl"] = str(folder / name), jsonl
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.datasets.tokenizer import build_tokenizer

    return build_tokenizer(TOKENIZER)


def mix_of(sources, weights=(0.5, 0.3, 0.2)) -> list[str]:
    return [f"{sources[n]}:{w}" for n, w in zip(("web", "code", "math"), weights)]


def loaders(tokenizer, mix, dp: int, batch: int, accum: int, **kw):
    """One loader per data-parallel rank."""
    return [
        build_text_data_loader(
            "pydocs",
            None,
            tokenizer,
            SEQ,
            compute_stream_groups(r, dp, batch, accum),
            dp * batch * accum,
            mix=mix,
            **kw,
        )
        for r in range(dp)
    ]


def read_steps(ranks, steps: int, accum: int, iters=None) -> tuple[list[torch.Tensor], list]:
    """Each step's global batch (rows in stream order) and each step's per-source counts."""
    iters = iters or [iter(r) for r in ranks]
    batches, counts = [], []
    for _ in range(steps):
        rows = [torch.cat([next(it)[0] for _ in range(accum)]) for it in iters]
        batches.append(torch.cat(rows))
        fields = [r.step_metrics()[0]["data_samples"] for r in ranks]
        assert all(f == fields[0] for f in fields), "ranks disagree on the step's per-source counts"
        counts.append(fields[0])
    return batches, counts


def test_global_batch_is_the_same_under_every_layout_and_counts_follow_the_weights(sources, tokenizer):
    mix = mix_of(sources)
    ref, ref_counts = read_steps(loaders(tokenizer, mix, 1, GLOBAL, 1), 12, 1)
    for dp, batch, accum in ((2, 4, 1), (2, 2, 2), (4, 1, 2)):
        got, counts = read_steps(loaders(tokenizer, mix, dp, batch, accum), 12, accum)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"dp {dp} x batch {batch} x accum {accum} differs"
        assert counts == ref_counts
    total = {n: sum(c[n] for c in ref_counts) for n in ref_counts[0]}
    assert list(total.values()) == [48, 29, 19]  # 96 samples at 0.5/0.3/0.2, within one sample of each share
    # every row is a real window of its source: documents end at EOS, so some windows hold one
    assert (torch.stack(ref) == tokenizer.eos_id).any()


def test_resume_under_another_dp_degree_mid_epoch_reads_the_same_next_samples(sources, tokenizer, caplog):
    mix = mix_of(sources)
    ref, _ = read_steps(loaders(tokenizer, mix, 1, GLOBAL, 1), 10, 1)
    first = loaders(tokenizer, mix, 2, 2, 2)
    read_steps(first, 6, 2)
    saved = merge_data_states([r.state_dict() for r in first])
    blend = saved["blend"]
    math_windows = first[0].dataset.sources[2].num_windows
    # the smallest source is mid-epoch (and past its first): the resume lands inside a reshuffled epoch
    assert blend["consumed"][2] > math_windows and blend["consumed"][2] % math_windows
    for dp, batch, accum in ((1, GLOBAL, 1), (4, 2, 1)):
        resumed = loaders(tokenizer, mix, dp, batch, accum)
        for r in resumed:
            r.load_state_dict(saved)
        got, _ = read_steps(resumed, 4, accum)
        assert all(torch.equal(a, b) for a, b in zip(got, ref[6:])), f"resumed at dp {dp} differs"


def test_mid_step_state_resumes_on_the_next_micro_batch(sources, tokenizer):
    mix = mix_of(sources)
    ref, _ = read_steps(loaders(tokenizer, mix, 1, GLOBAL, 1), 3, 1)
    (one,) = loaders(tokenizer, mix, 1, 2, 4)
    it = iter(one)
    got = [next(it)[0] for _ in range(5)]  # step 0's four micro-batches and step 1's first
    (again,) = loaders(tokenizer, mix, 1, 2, 4)
    again.load_state_dict(one.state_dict())
    it = iter(again)
    got += [next(it)[0] for _ in range(3)]
    assert torch.equal(torch.cat(got[:4]), ref[0]) and torch.equal(torch.cat(got[4:]), ref[1])


def test_text_and_indexed_states_do_not_load_into_each_other(sources, tokenizer):
    (indexed,) = loaders(tokenizer, mix_of(sources), 1, GLOBAL, 1)
    text = build_text_data_loader("pydocs", sources["web_jsonl"], tokenizer, SEQ, [list(range(GLOBAL))], GLOBAL)
    with pytest.raises(ValueError, match="data state is indexed data or a blend"):
        text.load_state_dict(indexed.state_dict())
    with pytest.raises(ConfigError, match="data state is text streams"):
        indexed.load_state_dict(text.state_dict())


def test_changed_mix_is_refused_in_one_line_unless_restart(sources, tokenizer):
    mix = mix_of(sources)
    (one,) = loaders(tokenizer, mix, 1, GLOBAL, 1)
    read_steps([one], 3, 1)
    saved = one.state_dict()
    (other,) = loaders(tokenizer, mix_of(sources, (0.2, 0.3, 0.5)), 1, GLOBAL, 1)
    with pytest.raises(ConfigError) as e:
        other.load_state_dict(saved)
    assert "training.dataset_mix differs from the checkpoint's" in str(e.value) and "\n" not in str(e.value)
    assert "training.dataset_mix_restart = true" in str(e.value)
    two = [f"{sources['web']}:1", f"{sources['code']}:1"]  # math dropped, weights changed
    (restarted,) = loaders(tokenizer, two, 1, GLOBAL, 1, restart_mix=True)
    restarted.load_state_dict(saved)
    web_before, code_before = saved["blend"]["consumed"][:2]
    _, counts = read_steps([restarted], 2, 1)
    assert [c[sources["web"]] for c in counts] == [4, 4]  # the rule restarted at 1:1
    state = restarted.state_dict()["blend"]
    assert state["consumed"] == [web_before + 8, code_before + 8] and state["mix_start"] == 3
    assert state["mixed"] == [8, 8]


def test_a_text_source_and_a_registered_name_blend_with_an_indexed_one(sources, tokenizer):
    mix = [f"{sources['web']}:0.5", f"{sources['code_jsonl']}:0.25", "pydocs_val:0.25"]
    batches, counts = read_steps(loaders(tokenizer, mix, 1, GLOBAL, 1), 2, 1)
    assert counts == [{sources["web"]: 4, sources["code_jsonl"]: 2, "pydocs_val": 2}] * 2
    # the jsonl source is tokenized in memory to the same token stream as its indexed twin
    (a,) = loaders(tokenizer, [f"{sources['code_jsonl']}:1"], 1, GLOBAL, 1)
    (b,) = loaders(tokenizer, [f"{sources['code']}:1"], 1, GLOBAL, 1)
    src_a, src_b = a.dataset.sources[0], b.dataset.sources[0]
    assert np.array_equal(src_a.read(0, src_a.num_tokens), src_b.read(0, src_b.num_tokens))


@pytest.mark.parametrize("weights", [(0.7, 0.2, 0.1), (1 / 3, 1 / 3, 1 / 3)])
def test_running_shares_stay_within_one_sample_of_the_weights_over_10000_steps(weights):
    rule, steps, worst = BlendRule(list(weights)), 10_000, 0.0
    w = np.array(weights)
    for step in range(1, steps + 1):
        for _ in range(GLOBAL):
            rule.next()
        n = step * GLOBAL
        worst = max(worst, float(np.abs(np.array(rule.counts) - w * n).max()))
        assert worst < 1.0, f"step {step}: counts {rule.counts} drift from {w * n} by a sample or more"
    assert sum(rule.counts) == steps * GLOBAL


@pytest.mark.parametrize(
    "entries, message",
    [
        (["a:-1", "b:1"], "is not a finite number >= 0"),
        (["a:x", "b:1"], "the weight 'x' is not a finite number"),
        (["a:nan"], "is not a finite number"),
        (["a:0", "b:0"], "weights sum to 0"),
        (["a"], "has no weight"),
        (["a:1", "a:2"], "more than once"),
        ([], "is empty"),
    ],
)
def test_bad_weights_are_one_line(entries, message):
    with pytest.raises(ConfigError) as e:
        parse_mix(entries)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_source_and_a_corpus_shorter_than_one_sample_are_one_line(sources, tokenizer, tmp_path):
    with pytest.raises(ConfigError) as e:
        loaders(tokenizer, [f"{sources['web']}:1", "no_such_corpus:1"], 1, GLOBAL, 1)
    assert "source 'no_such_corpus' is neither an existing path" in str(e.value) and "\n" not in str(e.value)
    tiny = write_jsonl(tmp_path / "tiny.jsonl", ["a b"])
    tokenize_to_indexed(tiny, str(tmp_path / "tiny"), TOKENIZER, progress=io.StringIO())
    with pytest.raises(ValueError) as e:
        build_text_data_loader("pydocs", str(tmp_path / "tiny"), tokenizer, SEQ, [[0]], 1)
    assert "fewer than one sample of training.seq_len + 1 = 33" in str(e.value) and "\n" not in str(e.value)


def test_the_preflight_knows_the_streamed_names():
    from torchtitan.datasets.indexed.checks import STREAMED
    from torchtitan.datasets.registry import DATASETS

    assert set(STREAMED) == {name for name, spec in DATASETS.items() if spec.default_path is None}
