"""The fine-tuning loader (torchtitan/datasets/sft/loader.py): bad rows in one line naming file and row, the
epoch plan (every example once per epoch, a new order each epoch), the layout invariance of the global
batch, and a resume that continues on the same next window, under another data-parallel layout too.
The pre-launch check of the fine-tuning keys (datasets/sft/checks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchtitan.config.manager import JobConfig
from torchtitan.datasets.hf_datasets import compute_stream_groups, merge_data_states
from torchtitan.datasets.sft.chat_template import ChatTokenizer
from torchtitan.datasets.sft.checks import check_fine_tuning
from torchtitan.datasets.sft.columns import ColumnMap
from torchtitan.datasets.sft.loader import SFTDataset, load_rows, tokenize_rows
from torchtitan.models.common.documents import IGNORE_INDEX

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "sft"
TOKENIZER = str(ASSETS / "tokenizer")
GOOD = {"messages": [{"role": "user", "content": "What is 1 plus 2?"}, {"role": "assistant", "content": "3"}]}


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer(TOKENIZER)


def _write(tmp_path: Path, rows: list[dict], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _examples(path: str, chat: ChatTokenizer, fmt: str = "chat", loss_on: str = "assistant"):
    return tokenize_rows(load_rows("sft_arith", path), chat, fmt=fmt, loss_on=loss_on, columns=ColumnMap())


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"prompt": "x", "messages": None}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "1"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "What is 1 plus 2?"}]}, "no assistant turn"),
        # the shipped template raises for a system message that is not the first
        (
            {"messages": [GOOD["messages"][0], {"role": "system", "content": "late"}, GOOD["messages"][1]]},
            "row 2: ",
        ),
    ],
    ids=["no_messages", "unknown_role", "no_assistant", "template_error"],
)
def test_a_bad_row_is_one_line_naming_file_and_row(tmp_path, chat, bad, says):
    path = _write(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError) as e:
        _examples(path, chat)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: row 2: ") and says in message, message


def test_the_wrong_shape_names_the_file_its_columns_and_the_fix(tmp_path, chat):
    path = str(ASSETS / "arith_prompt_completion.jsonl")
    with pytest.raises(ValueError, match=r"dataset_format = 'chat' reads the column\(s\) \['messages'\].*prompt"):
        _examples(path, chat)
    assert len(_examples(path, chat, fmt="prompt_completion", loss_on="completion")) == 50


def _dataset(examples, *, dp_rank=0, dp=1, batch=8, accum=1, seed=0) -> SFTDataset:
    return SFTDataset(
        "test",
        examples,
        seq_len=128,
        pad_id=0,
        overlong="truncate",
        seed=seed,
        stream_groups=compute_stream_groups(dp_rank, dp, batch, accum),
        num_streams=dp * batch * accum,
    )


@pytest.fixture(scope="module")
def examples(chat):
    return _examples(str(ASSETS / "arith_val.jsonl"), chat)


def _epoch_examples(ds: SFTDataset, epoch: int) -> list[list[int]]:
    """Each window of ``epoch``, as the token lists of the examples it holds."""
    out = []
    for w in range(epoch * ds.windows_per_epoch, (epoch + 1) * ds.windows_per_epoch):
        tokens, labels, doc_ids, positions, real, _ = ds.window(w)
        assert all(t == IGNORE_INDEX for t in labels[real:]) and len(tokens) == 128
        out.append([[t for t, d in zip(tokens[:real], doc_ids[:real]) if d == doc] for doc in range(doc_ids[-1] + 1)])
    return out


def test_each_epoch_holds_every_example_once_in_a_new_order(examples):
    ds = _dataset(examples)
    want = sorted(list(t) for t, _ in examples)
    epochs = [_epoch_examples(ds, e) for e in (0, 1)]
    for windows in epochs:
        got = sorted(ex for window in windows for ex in window if ex)
        assert got == want
    assert epochs[0] != epochs[1]  # reshuffled
    assert max(len([e for e in w if e]) for w in epochs[0]) >= 3  # windows hold several examples


def _step(loaders: list, accum: int) -> torch.Tensor:
    """One global batch: the micro-batches of each rank in rank order, stacked (inputs only)."""
    return torch.cat([next(it)[0] for it in loaders for _ in range(accum)])


def test_global_batch_is_a_function_of_the_global_batch_only(examples):
    one = iter(_dataset(examples, batch=8))
    layouts = [[iter(_dataset(examples, dp_rank=r, dp=2, batch=2, accum=2)) for r in range(2)]]
    for _ in range(5):  # past the end of epoch 0
        want = next(one)[0]
        for its in layouts:
            assert torch.equal(_step(its, 2), want)


def test_resume_continues_on_the_next_window_under_another_layout(examples):
    ranks = [_dataset(examples, dp_rank=r, dp=2, batch=4) for r in range(2)]
    its = [iter(d) for d in ranks]
    for _ in range(3):
        _step(its, 1)
    states = [d.state_dict() for d in ranks]
    reference = _step(its, 1)
    resumed = _dataset(examples, batch=8)
    resumed.load_state_dict(merge_data_states(states))
    assert torch.equal(next(iter(resumed))[0], reference)
    other = _examples(str(ASSETS / "arith_val.jsonl"), ChatTokenizer(TOKENIZER), loss_on="all")
    with pytest.raises(ValueError, match="fine-tuning other data"):
        _dataset(other, batch=8).load_state_dict(merge_data_states(states))


def _config(*args: str) -> JobConfig:
    return JobConfig.parse_args(["--job.config_file", "train_configs/sft_debug.toml", *args])


def test_check_refuses_what_cannot_work():
    assert check_fine_tuning(_config(), None) == []
    cases = {
        ("--training.dataset_format", "text", "--training.loss_on", "all"): "applies to fine-tuning data",
        ("--model.attn_mask_type", "causal"): "attend across examples",
        ("--training.loss_on", "completion"): "is for prompt_completion data",
        ("--model.tokenizer_path", "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"): "Hugging Face",
        ("--training.dataset_columns", "messages"): "each entry is field=column",
    }
    for args, says in cases.items():
        with pytest.raises(ValueError, match=says):
            check_fine_tuning(_config(*args), None)


def test_parquet_and_folders_are_read_and_errors_name_the_file(tmp_path, chat):
    from datasets import Dataset

    folder = tmp_path / "folder"
    folder.mkdir()
    Dataset.from_list([GOOD, GOOD]).to_parquet(str(folder / "a.parquet"))
    assert len(_examples(str(folder / "a.parquet"), chat)) == 2
    mixed = tmp_path / "jsonl_folder"
    mixed.mkdir()
    _write(mixed, [GOOD, GOOD], "part1.jsonl")
    second = _write(mixed, [GOOD, {"messages": [{"role": "user", "content": "x"}]}], "part2.jsonl")
    with pytest.raises(ValueError, match=rf"^{second}: row 1: the conversation has no assistant turn"):
        _examples(str(mixed), chat)
