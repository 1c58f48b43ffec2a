"""Bad indexed data and blends are refused before launch: ``python -m torchtitan.preflight`` (what
run_llama_train.sh runs before torchrun) exits 2 with one line naming the key, the value and the fix."""

from __future__ import annotations

import io
import os
import shutil

import pytest

from tests.support.indexed import TOKENIZER, write_jsonl
from tests.support.runs import ROOT
from torchtitan.datasets.indexed.tokenize import tokenize_to_indexed


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("preflight")
    jsonl = write_jsonl(folder / "web.jsonl", [f"web page {i} " * 9 for i in range(50)])
    tokenize_to_indexed(jsonl, str(folder / "web"), TOKENIZER, progress=io.StringIO())
    tiny = write_jsonl(folder / "tiny.jsonl", ["a b c"])
    tokenize_to_indexed(tiny, str(folder / "tiny"), TOKENIZER, progress=io.StringIO())
    for broken in ("no_idx", "bad_magic"):
        shutil.copy(folder / "web.bin", folder / f"{broken}.bin")
    shutil.copy(folder / "web.idx", folder / "bad_magic.idx")
    with open(folder / "bad_magic.idx", "r+b") as f:
        f.write(b"XXXXXXX")
    return str(folder)


def mix(*entries: str) -> list[str]:
    return ["--training.dataset_mix", ",".join(entries)]  # a list on the command line: comma-separated


@pytest.mark.parametrize(
    "args, expected",
    [
        (mix("D/web:-0.5", "D/web.jsonl:1"), "training.dataset_mix entry 'D/web:-0.5': the weight '-0.5' is not a"),
        (mix("D/web:0", "D/web.jsonl:0"), "training.dataset_mix weights sum to 0.0"),
        (mix("D/web:abc"), "the weight 'abc' is not a finite number"),
        (mix("D/web:1", "math_corpus:1"), "training.dataset_mix source 'math_corpus' is neither an existing path"),
        (mix("D/web:1", "fineweb:1"), "source 'fineweb' is streamed from the hub; tokenize a local copy once"),
        (mix("D/no_idx:1"), "'D/no_idx.bin' is there but 'D/no_idx.idx' is missing"),
        (mix("D/bad_magic.bin:1"), "is not a Megatron-LM indexed dataset index"),
        (["--training.dataset_path", "D/bad_magic"], "training.dataset_path = 'D/bad_magic': 'D/bad_magic.idx' is not"),
        ([*mix("D/web:1"), "--training.dataset_path", "D/web"], "training.dataset_mix and training.dataset_path"),
        (
            mix("D/web:1", "D/tiny:1"),
            "source = 'D/tiny' has 5 tokens, fewer than one sample of training.seq_len + 1 = 257",
        ),
        (
            [*mix("D/web:1"), "--fault_tolerance.enable", "--fault_tolerance.group_size", "2"],
            "with fault_tolerance.enable = true is not supported yet",
        ),
    ],
    ids=[
        "negative",
        "zero-sum",
        "not-a-number",
        "unknown-source",
        "streamed",
        "missing-idx",
        "magic",
        "path-magic",
        "both",
        "too-short",
        "fault-tolerance",
    ],
)
def test_bad_blend_or_indexed_data_is_one_line_before_launch(args, expected, data, capsys, monkeypatch):
    from torchtitan.preflight.__main__ import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")  # the fault-tolerance case's machine check
    args = [a.replace("D/", data + "/") for a in args]
    code = main(["--world_size", "2", "--job.config_file", "./train_configs/debug_model.toml", *args])
    out = capsys.readouterr()
    lines = [line for line in (out.err + out.out).splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and expected.replace("D/", data + "/") in lines[0], out.err + out.out
    assert "Traceback" not in out.err + out.out


def test_a_good_blend_passes_the_preflight(data, capsys, monkeypatch):
    from torchtitan.preflight.__main__ import main

    monkeypatch.chdir(ROOT)
    args = mix(f"{data}/web:0.7", f"{data}/web.jsonl:0.2", "pydocs:0.1")
    assert main(["--world_size", "2", "--job.config_file", "./train_configs/debug_model.toml", *args]) == 0, (
        capsys.readouterr().err
    )
    assert os.path.isfile(f"{data}/web.idx")
