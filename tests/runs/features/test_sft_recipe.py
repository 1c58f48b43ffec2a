"""The fine-tuning recipe of docs/sft.md, end to end at the smallest size: an HF folder in -> SFT on the
shipped chat task -> an HF folder out -> ``scripts/generate.py --hf OUT --chat``.

* In: a random-init ``LlamaForCausalLM`` of the parity flavor's shapes (debugmodel_tiny, the chat
  tokenizer's 336 words), saved by transformers in shards with the tokenizer's files beside it, as a
  user's model folder is; the run reads its tokenizer from that folder too.
* SFT: 3 steps on the chat rows (block-causal packing, loss on the assistant turns) in the worker pool,
  with ``checkpoint.initial_load_in_hf`` and ``checkpoint.last_save_in_hf``.
* Out: transformers loads the export with no missing or unexpected weight, and its logits for a chat
  prompt equal our model's from the run's last checkpoint (fp32: 1e-5, as tests/unit/test_hf_parity.py).
* The CLI, as a user runs it (a subprocess: its exit code and what it prints): exit 0 and one non-empty
  line, the answer this process generates greedily from the checkpoint for the same prompt.

How well the recipe trains is bench/sft_arith.py's question (docs/performance.md); this checks the
chain holds. Measured on 2 shared cores: the test 6-8 s (10 s with pytest's start-up), of which the
1-rank pool's start 2.2-2.5 s and its 3-step job 0.6-0.7 s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support.hf import hf_logits, save_random_hf_model
from tests.support.rows import SFT_TRAIN
from tests.support.runs import ROOT, read_metrics, train, trainer_argv
from tests.support.scripts import generate_script

pytestmark = [pytest.mark.integration, pytest.mark.pool(1)]

STEPS = 3
QUESTION = "What is 7 plus 5?"
NEW_TOKENS = 8
SFT_TOKENIZER = os.path.join(ROOT, "tests", "assets", "sft", "tokenizer")


def _hf_in(folder: str) -> None:
    """The user's HF folder: the model at the run's shapes and its tokenizer, both by save_pretrained."""
    from transformers import AutoTokenizer

    save_random_hf_model(trainer_argv(SFT_TRAIN, folder), folder)  # the flavor and vocabulary train() runs
    AutoTokenizer.from_pretrained(SFT_TOKENIZER).save_pretrained(folder)


def _ours(checkpoint: str, tokenizer: str) -> tuple[list[int], torch.Tensor, str]:
    """The chat prompt's ids, our model's logits for them (from the checkpoint) and its greedy answer."""
    from torchtitan.components.generation import generate
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.datasets.sft.prompting import chat_prompt_ids, chat_stop_ids, decode_answer

    chat = ChatTokenizer(tokenizer)
    ids = chat_prompt_ids(chat, QUESTION)
    model = generate_script().load_model(
        checkpoint, None, len(ids) + NEW_TOKENS, chat.base.n_words, torch.device("cpu")
    )
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    out = generate(model, torch.tensor([ids]), NEW_TOKENS, stop_token=chat_stop_ids(chat))
    return ids, logits, decode_answer(chat, out[0, len(ids) :].tolist(), chat_stop_ids(chat))


def test_hf_in_sft_hf_out_generate_chat(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' tokenizer and data paths are relative to the checkout
    hf_in, folder = str(tmp_path / "hf_in"), str(tmp_path / "run")
    _hf_in(hf_in)
    run = train(
        1,
        folder,
        [
            *SFT_TRAIN,
            *("--model.tokenizer_path", hf_in, "--training.steps", str(STEPS), "--training.batch_size", "4"),
            *("--checkpoint.enable_checkpoint", "--checkpoint.interval", str(STEPS)),
            *("--checkpoint.initial_load_path", hf_in, "--checkpoint.initial_load_in_hf"),
            "--checkpoint.last_save_in_hf",
        ],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"started from Hugging Face weights in {hf_in}" in run.stderr, run.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(folder) if "loss" in r]
    assert len(losses) == STEPS and losses[-1] < losses[0], losses
    hf_out = os.path.join(folder, "hf", f"step-{STEPS}")
    ids, ours, answer = _ours(os.path.join(folder, "checkpoint", f"step-{STEPS}"), hf_in)

    theirs = hf_logits(hf_out, torch.tensor([ids]))
    print(f"losses {losses}; answer {answer!r}; logits max |ours - transformers| {(ours - theirs).abs().max():.1e}")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    cmd = [sys.executable, "scripts/generate.py", "--hf", hf_out, "--tokenizer", hf_in, "--chat"]
    cmd += ["--prompt", QUESTION, "--max_new_tokens", str(NEW_TOKENS)]
    cli = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip() and cli.stdout.count("\n") == 1, repr(cli.stdout)
    assert cli.stdout == answer + "\n", (cli.stdout, answer)
