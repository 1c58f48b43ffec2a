"""A prompt is encoded by the tokenizer's own rule wherever an HF tokenizer encodes one (``Tokenizer.encode_prompt``):
transformers' ``tokenizer(text)``, whose post-processor decides the special tokens; a chat template's text decides its
own. Four folders of the shipped chat tokenizer beside one tiny random Qwen3 saved by transformers: one whose
``tokenizer.json`` adds a bos, one saved by transformers from ``AutoTokenizer(..., bos_token=...)`` (the config names a
bos, the tokenizer adds none: issue 84's DeepSeek-V3 folder), one whose config sets ``add_bos_token`` (transformers 5
drops it beside a tokenizer.json) and the shipped one (no bos). For each: ``scripts/generate.py --hf`` prints
transformers' greedy ``generate`` text; the lm-eval backend's ``tok_encode`` and RL's prompt rows give transformers' ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.hf import tiny_qwen3
from tests.support.scripts import generate_script
from torchtitan.datasets.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "tests" / "assets" / "sft" / "tokenizer"
BOS = "<|reserved_0|>"  # an added special token of the shipped tokenizer, named as the bos
PROMPT = "What is 12 plus 7?"
NEW_TOKENS = 8
KINDS = ("adds_bos", "names_bos_adds_none", "config_add_bos_token", "no_bos")


def _tokenizer_files(folder: Path, kind: str) -> None:
    if kind == "names_bos_adds_none":  # as transformers saves it
        transformers.AutoTokenizer.from_pretrained(TOKENIZER, bos_token=BOS).save_pretrained(folder)
        return
    shutil.copy(TOKENIZER / "tokenizer.json", folder)
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    if kind == "adds_bos":  # Llama 3's way: the tokenizer.json's post-processor adds it
        import tokenizers
        from tokenizers.processors import TemplateProcessing

        model = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
        bos_id = model.token_to_id(BOS)
        model.post_processor = TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        )
        model.save(str(folder / "tokenizer.json"))
    if kind != "no_bos":
        config["bos_token"] = BOS
    if kind == "config_add_bos_token":
        config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """kind -> a folder with the same tiny random Qwen3 and that kind of tokenizer."""
    words = build_tokenizer(str(TOKENIZER)).n_words
    model = tiny_qwen3(words, initializer_range=0.5)  # logits spread well apart: greedy steps far from ties
    out = {}
    for kind in KINDS:
        folder = tmp_path_factory.mktemp(kind)
        model.save_pretrained(folder)
        _tokenizer_files(folder, kind)
        out[kind] = folder
    return out


def _transformers_greedy(folder: Path, ids: list[int]) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=False)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_prints_transformers_greedy_text(folders, kind, capsys):
    folder = folders[kind]
    ids = transformers.AutoTokenizer.from_pretrained(folder)(PROMPT).input_ids
    bos_id = build_tokenizer(str(TOKENIZER)).model.token_to_id(BOS)
    assert (ids[0] == bos_id) == (kind == "adds_bos")  # the folder is the kind its name says
    assert generate_script().main(["--hf", str(folder), "--prompt", PROMPT, "--max_new_tokens", str(NEW_TOKENS)]) == 0
    want = _transformers_greedy(folder, ids)
    assert capsys.readouterr().out == want + "\n"
    assert build_tokenizer(str(folder)).encode_prompt(PROMPT) == ids
    # the check can fail: a bos added or dropped changes this model's text from the first token
    other = ids[1:] if ids[0] == bos_id else [bos_id, *ids]
    assert _transformers_greedy(folder, other) != want, want


@pytest.mark.parametrize("kind", KINDS)
def test_eval_backend_and_rl_prompts_encode_as_transformers(folders, kind, tmp_path):
    """lm-eval's ``tok_encode`` (its default: the tokenizer's own special tokens; a task's special-token text is the
    token) gives ``tokenizer(text)``; an RL prompt row gives ``apply_chat_template(..., add_generation_prompt=True)``
    (the template writes its special tokens; no bos added on top)."""
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.distributed.mesh import WorldMesh
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.eval.lm import TorchtitanLM
    from torchtitan.eval.model import EvalModel
    from torchtitan.features.rl.prompts import PromptSource

    folder = folders[kind]
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = build_tokenizer(str(folder))
    world = WorldMesh(ParallelDims(1, 1, 1, 1, 1, 1, False), None)
    lm = TorchtitanLM(model=EvalModel(torch.nn.Identity(), ours, world, torch.device("cpu"), 64))
    text = "Question: 2 plus 3<|im_end|>\nAnswer:"
    assert lm.tok_encode(text) == theirs(text).input_ids
    assert lm.tok_encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False).input_ids
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    source = PromptSource(
        str(rows), ChatTokenizer(str(folder)), seed=0, per_step=1, group_size=1, max_new_tokens=8, seq_len=64
    )
    messages = [{"role": "user", "content": PROMPT}]
    assert source.prompts[0].ids == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
