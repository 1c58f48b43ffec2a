"""``scripts/generate.py --chat`` and ``torchtitan/datasets/sft/prompting.py``: the chat prompt's ids equal
transformers' ``apply_chat_template(add_generation_prompt=True)``, the answer stops at the end of the turn,
and only the answer is printed.

The end-to-end run uses a hand-built model whose next token depends only on the current one (attention
and FFN outputs zeroed, one-hot embeddings), wired as a chain: the prompt's last token (the newline after
the assistant header) -> "1" -> "9" -> "." -> <|im_end|> -> "What". So its answer is known exactly, and a
run that did not stop at <|im_end|> would print "19.What". A tokenizer whose eos is <|endoftext|> has it as
the second stop id, and generation ends there as well.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from torchtitan.checkpointing.hf.convert import save_hf_folder
from torchtitan.datasets.sft.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTokenizer
from torchtitan.datasets.sft.prompting import answer_ids, chat_messages, chat_prompt_ids, chat_stop_ids
from torchtitan.distributed.init import init_model_weights
from torchtitan.models.llama.hf_adapter import ADAPTER as hf_adapter
from torchtitan.models.llama.model import ModelArgs, Transformer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "generate.py"
SHIPPED = str(ROOT / "tests" / "assets" / "sft" / "tokenizer")
QUESTION = "What is 12 plus 7?"
SYSTEM = "Answer with the number only."


@functools.cache
def _script():
    """scripts/generate.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def _chat() -> ChatTokenizer:
    return ChatTokenizer(SHIPPED)


def _hf_ids(hf, messages: list[dict], **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _copy_with_config(tmp_path: Path, **changes) -> str:
    """The shipped tokenizer folder with ``changes`` to its config (a None value removes the key)."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(SHIPPED, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None or k not in changes}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["default-system", "system"])
def test_prompt_ids_equal_transformers(system):
    hf = AutoTokenizer.from_pretrained(SHIPPED)
    messages = chat_messages(QUESTION, system=system)
    ours = chat_prompt_ids(_chat(), QUESTION, system=system)
    assert ours == _hf_ids(hf, messages)
    # the tokenizer's own template, not the built-in one: they differ by its default system prompt
    builtin = _hf_ids(hf, messages, chat_template=DEFAULT_CHAT_TEMPLATE)
    assert (ours == builtin) == (system is not None)
    assert hf.decode(ours).endswith("<|im_start|>assistant\n")
    # the script's prompt for these arguments is the same
    args = ["--hf", "unused", "--tokenizer", SHIPPED, "--chat", "--prompt", QUESTION]
    args += ["--system", system] if system is not None else []
    assert _script().build_prompt(_script()._parser().parse_args(args)).ids == ours


def test_without_a_template_the_builtin_chatml_renders(tmp_path):
    folder = _copy_with_config(tmp_path, chat_template=None)
    hf = AutoTokenizer.from_pretrained(folder)
    ours = chat_prompt_ids(ChatTokenizer(folder), QUESTION)
    assert ours == _hf_ids(hf, chat_messages(QUESTION), chat_template=DEFAULT_CHAT_TEMPLATE)


def test_stop_ids(tmp_path):
    im_end = _chat().base.model.token_to_id("<|im_end|>")
    assert _chat().base.eos_id == im_end and chat_stop_ids(_chat()) == (im_end,)
    # a base model's eos is not the end of a chat turn: stop on both, the end-of-turn token first
    other = ChatTokenizer(_copy_with_config(tmp_path, eos_token="<|endoftext|>"))
    assert chat_stop_ids(other) == (im_end, other.base.model.token_to_id("<|endoftext|>"))
    assert answer_ids([5, 6, 0, 2, 7], (2, 0)) == [5, 6] and answer_ids([5, 6], (2,)) == [5, 6]


def _chain_model(tmp_path: Path, chain: list[str], **save_kwargs) -> str:
    """An HF folder of a llama whose greedy next token after ``chain[i]`` is ``chain[i + 1]``
    (``save_kwargs``: ``save_hf_folder``'s, e.g. a shard size)."""
    vocab = _chat().base.model
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=_chat().base.n_words, max_seq_len=128)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    init_model_weights(model, 0, torch.device("cpu"))
    with torch.no_grad():
        for block in model.layers.values():  # each block adds nothing: the last layer sees the token's embedding
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        model.output.weight.zero_()
        for i, (src, dst) in enumerate(zip(chain, chain[1:])):
            basis = torch.zeros(args.dim)
            basis[i] = 1.0
            model.tok_embeddings.weight[vocab.token_to_id(src)] = basis
            model.output.weight[vocab.token_to_id(dst)] = basis  # the only positive logit after src
    sd, fields = model.state_dict(), dataclasses.asdict(args)
    config = hf_adapter.hf_config(fields, sd, torch.float32)
    save_hf_folder(hf_adapter.to_hf_state_dict(sd, fields), config, str(tmp_path / "model"), **save_kwargs)
    return str(tmp_path / "model")


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["default-system", "system"])
def test_chat_prints_the_answer_and_stops_at_the_end_of_turn(tmp_path, capsys, system):
    folder = _chain_model(tmp_path, ["Ċ", "1", "9", ".", "<|im_end|>", "What"])
    argv = ["--hf", folder, "--tokenizer", SHIPPED, "--chat", "--prompt", QUESTION, "--max_new_tokens", "8"]
    argv += ["--system", system] if system is not None else []
    assert _script().main(argv) == 0
    assert capsys.readouterr().out == "19.\n"
    # the same model and prompt without --chat: the question's last token ("?") starts no chain, and the
    # plain run prints what it generates, special tokens and all, up to eos
    assert _script().main([*argv[:4], "--prompt", QUESTION + "\n", "--max_new_tokens", "8"]) == 0
    assert capsys.readouterr().out == "19.<|im_end|>\n"


def test_chat_generation_ends_at_the_second_stop_id(tmp_path, capsys):
    """A base model's eos (here <|endoftext|>) is the second of the chat stop ids: generation ends there too,
    not at --max_new_tokens. The folder is sharded as save_pretrained shards (an index file): --hf reads it."""
    tokenizer = _copy_with_config(tmp_path, eos_token="<|endoftext|>")
    folder = _chain_model(tmp_path, ["Ċ", "1", "9", ".", "<|endoftext|>", "What", "is"], max_shard_bytes=40_000)
    assert (Path(folder) / "model.safetensors.index.json").is_file()
    argv = ["--hf", folder, "--tokenizer", tokenizer, "--chat", "--prompt", QUESTION, "--max_new_tokens", "8"]
    script = _script()
    args = script._parser().parse_args(argv)
    prompt = script.build_prompt(args)
    endoftext = _chat().base.model.token_to_id("<|endoftext|>")
    assert prompt.stop_ids[1] == endoftext
    model = script.load_model(None, folder, len(prompt.ids) + 8, prompt.n_words, torch.device("cpu"))
    generated = script.complete(model, prompt, args, torch.device("cpu"))
    assert generated == [*(_chat().base.model.token_to_id(t) for t in "19."), endoftext]
    assert script.main(argv) == 0 and capsys.readouterr().out == "19.\n"


def test_chat_with_a_tiktoken_tokenizer_is_refused_in_one_line(capsys):
    assert _script().main(["--hf", "unused", "--chat", "--prompt", QUESTION]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --chat needs a Hugging Face tokenizer"), err
    assert "tiktoken" in err and "--tokenizer" in err and "tests/assets/sft/tokenizer" in err
    with pytest.raises(SystemExit) as exit_info:
        _script().main(["--hf", "unused", "--prompt", QUESTION, "--system", SYSTEM])
    assert exit_info.value.code == 2 and "add --chat" in capsys.readouterr().err
