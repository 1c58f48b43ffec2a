"""Hugging Face tokenizer.json tokenizers (Qwen3's format): special tokens from tokenizer_config.json,
build_tokenizer's choice of format, errors, the download script's layouts, and a debug run with one."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.support.hf import SPECIAL, VOCAB_SIZE, corpus_texts, write_tokenizer
from torchtitan.build import build_model_args
from torchtitan.config.manager import JobConfig
from torchtitan.datasets.tokenizer import HFTokenizer, TikTokenizer, Tokenizer, build_tokenizer, find_tokenizer_file
from torchtitan.preflight import run_preflight
from torchtitan.preflight.__main__ import main as check_config
from torchtitan.spec import get_model_spec
from torchtitan.train import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_BPE = REPO_ROOT / "torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out as download_tokenizer.py saves Qwen3's: no bos, eos given as a dict."""
    folder = tmp_path_factory.mktemp("qwen_like")
    config = {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>"}
    write_tokenizer(folder, config)
    return folder


@pytest.fixture(scope="module")
def tokenizer(qwen_like: Path) -> HFTokenizer:
    tok = build_tokenizer(str(qwen_like))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    return tok


def test_round_trip_and_eos(tokenizer: HFTokenizer) -> None:
    texts = corpus_texts(40) + ["Ünïcödé ✓ 日本語 emoji 🚀 and tabs\t\tand\r\nnewlines", " " * 5000 + "x"]
    for text in texts:
        ids = tokenizer.encode(text, bos=False, eos=True)
        assert ids[-1] == tokenizer.eos_id and all(0 <= i < tokenizer.n_words for i in ids)
        assert tokenizer.decode(ids[:-1]) == text
    assert tokenizer.encode("", bos=False, eos=False) == []
    assert tokenizer.decode([tokenizer.eos_id]) == "<|im_end|>"  # special tokens decode to their text


def test_special_ids_and_vocab(tokenizer: HFTokenizer) -> None:
    assert tokenizer.n_words == tokenizer.model.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert (tokenizer.eos_id, tokenizer.pad_id) == (SPECIAL.index("<|im_end|>"), SPECIAL.index("<|endoftext|>"))


def test_no_bos_token_prepends_nothing(tokenizer: HFTokenizer) -> None:
    assert tokenizer.bos_id == -1
    text = "def f(x):\n    return x"
    assert tokenizer.encode(text, bos=True, eos=False) == tokenizer.encode(text, bos=False, eos=False)


def test_bos_token_when_configured(tmp_path: Path) -> None:
    file = write_tokenizer(tmp_path / "with_bos", {"bos_token": "<|im_start|>", "eos_token": "<|endoftext|>"})
    tok = build_tokenizer(str(file))  # the file itself, not its folder
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 0, -1)
    ids = tok.encode("hello world", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 0 and tok.decode(ids[1:-1]) == "hello world"


def test_special_token_text_is_ordinary_text(tokenizer: HFTokenizer) -> None:
    text = "a web page that says <|endoftext|> and <|im_end|>"
    ids = tokenizer.encode(text, bos=False, eos=False)
    assert not set(ids) & {0, 1, 2}
    assert tokenizer.decode(ids) == text


def test_build_tokenizer_picks_the_format(qwen_like: Path) -> None:
    assert isinstance(build_tokenizer(str(qwen_like)), HFTokenizer)
    assert isinstance(build_tokenizer(str(qwen_like / "tokenizer.json")), HFTokenizer)
    assert isinstance(build_tokenizer(str(SHIPPED_BPE)), TikTokenizer)
    assert find_tokenizer_file(str(qwen_like)) == qwen_like / "tokenizer.json"
    assert find_tokenizer_file(str(SHIPPED_BPE)) == SHIPPED_BPE
    assert find_tokenizer_file(str(qwen_like / "nope")) is None


def test_missing_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="download_tokenizer.py") as e:
        build_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))
    assert str(tmp_path / "nope" / "tokenizer.json") in str(e.value)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        build_tokenizer(str(tmp_path))


def test_bad_file_errors(tmp_path: Path, qwen_like: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json") as e:
        build_tokenizer(str(tmp_path))
    assert str(bad) in str(e.value)
    bad.write_text((qwen_like / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match=r"tokenizer_config.json is missing") as e:
        build_tokenizer(str(bad))
    assert str(bad) in str(e.value)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": null}')
    with pytest.raises(ValueError, match="has no eos_token"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ValueError, match="eos_token '</s>' is not in the tokenizer's vocabulary"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(
        ValueError, match=r"tokenizer_config.json: line 1, column 2: not valid JSON \(.*\); fix that line"
    ):
        build_tokenizer(str(tmp_path))


def _download_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("download_tokenizer", REPO_ROOT / "scripts/download_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # @dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


# The shipped real-size configs with a Hugging Face tokenizer: (file, the world size its header names, the repo)
REAL_SIZE_HF = [
    ("qwen3_8b.toml", 8, "Qwen/Qwen3-8B"),
    ("qwen3_moe_30b_a3b.toml", 8, "Qwen/Qwen3-30B-A3B"),
    ("qwen3_5_9b.toml", 8, "Qwen/Qwen3.5-9B"),
    ("qwen3_5_moe_35b_a3b.toml", 8, "Qwen/Qwen3.5-35B-A3B"),
    ("deepseek_v3_16b.toml", 8, "deepseek-ai/DeepSeek-V2-Lite"),
    ("deepseek_v3_671b.toml", 256, "deepseek-ai/DeepSeek-V3"),
    ("gpt_oss_20b.toml", 8, "openai/gpt-oss-20b"),
    ("gpt_oss_120b.toml", 64, "openai/gpt-oss-120b"),
]


def test_download_script_layouts_and_help(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _download_script(monkeypatch)
    qwen = script.resolve_layout("Qwen/Qwen3-8B")
    assert qwen == script.Layout(
        "", ("tokenizer.json", "tokenizer_config.json"), "torchtitan/datasets/tokenizer/Qwen3-8B"
    )
    llama = script.resolve_layout("meta-llama/Meta-Llama-3.1-8B")
    assert llama == script.Layout("original", ("tokenizer.model",), "torchtitan/datasets/tokenizer/")
    custom = script.resolve_layout("Qwen/Qwen3-8B", tokenizer_path="sub", files=["tokenizer.json"], local_dir="x")
    assert custom == script.Layout("sub", ("tokenizer.json",), "x")
    with pytest.raises(SystemExit) as e:
        script.main(["--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "--files" in help_text and "Qwen/Qwen3-8B" in help_text
    # each shipped config with a Hugging Face tokenizer: its folder is where the script saves its repo's tokenizer
    for name, _, repo in REAL_SIZE_HF:
        config = JobConfig.parse_args(["--job.config_file", str(REPO_ROOT / "train_configs" / name)])
        assert os.path.normpath(config.model.tokenizer_path) == script.resolve_layout(repo).local_dir
        assert f"--repo_id {repo}" in (REPO_ROOT / "train_configs" / name).read_text()


@pytest.mark.parametrize(("name", "world_size"), [(n, w) for n, w, _ in REAL_SIZE_HF])
def test_real_size_configs_pass_the_check_without_the_tokenizer(name: str, world_size: int) -> None:
    assert f"NGPU={world_size} " in (REPO_ROOT / "train_configs" / name).read_text()
    config = JobConfig.parse_args(["--job.config_file", str(REPO_ROOT / "train_configs" / name)])
    assert run_preflight(config, world_size, this_machine=False) == []


def _debug_args(tokenizer_folder: Path, dump: Path) -> list[str]:
    return [
        "--job.config_file",
        str(REPO_ROOT / "train_configs/qwen3_debug_model.toml"),
        "--model.tokenizer_path",
        str(tokenizer_folder),
        "--job.dump_folder",
        str(dump),
        "--training.seq_len",
        "32",
        "--training.batch_size",
        "2",
        "--training.steps",
        "1",
    ]


def test_debug_run_with_a_tokenizer_folder(qwen_like: Path, tmp_path: Path, monkeypatch) -> None:
    """The pre-launch check accepts the folder (and refuses a folder without tokenizer.json); one
    process builds the model at the tokenizer's vocabulary and a data loader of its tokens."""
    monkeypatch.chdir(REPO_ROOT)
    args = _debug_args(qwen_like, tmp_path / "run")
    assert check_config(args) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_config(_debug_args(empty, tmp_path / "run")) == 2
    config = JobConfig.parse_args(args)
    assert build_model_args(config, get_model_spec("qwen3"), VOCAB_SIZE).vocab_size == VOCAB_SIZE
    trainer = Trainer(config, world_size=1, rank=0)
    try:
        assert trainer.model_args.vocab_size == VOCAB_SIZE
        inputs, labels = next(iter(trainer.data_loader))
        assert inputs.shape == labels.shape == (2, 32)
        assert int(torch.cat([inputs, labels]).max()) < VOCAB_SIZE  # every id has an embedding row
        # stream i starts at document i, with no bos token in front of it
        tok = build_tokenizer(str(qwen_like))
        for row, text in zip(inputs.tolist(), corpus_texts(2)):
            assert row == tok.encode(text, bos=True, eos=False)[:32]
    finally:
        trainer.close()
