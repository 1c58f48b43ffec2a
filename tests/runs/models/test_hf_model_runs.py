"""``model.name = "hf"``: transformers' own causal LMs through the trainer (worker-pool jobs), tiny random configs.

Per architecture a 1-rank reference, a data-parallel row and (where its TP plan is built) TP2 at 2 ranks, at the
matrix's rtol; the options ride on the data-parallel rows (full AC on Gemma 3's FSDP2 row, selective op AC on
Phi-3's, DDP with each layer compiled for OLMo 2; SmolLM3's rows fine-tune on chat data with block_causal documents). Mistral's reference
checkpoints and exports to HF: the export loads in transformers with the built model's logits, a resume on FSDP2
continues the reference's losses, and LoRA over that export (1 rank, FSDP2, TP2) is at parity, its PEFT export loading
in peft with the merged export's logits. The logits of every built model equal
transformers' own class with the same weights (tests/unit/test_hf_model.py, in process).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.matrix import Row
from tests.support.pool import run_train_job
from tests.support.rows import HF, HF_STEPS
from tests.support.runs import ROOT, read_metrics
from tests.support.scripts import script_main

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2, 4)]

RTOL = 1e-5  # the matrix's
CHECKPOINT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
OP_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
DDP = ["--training.data_parallel_shard_degree", "1", "--training.data_parallel_replicate_degree", "2"]
# flavor -> (its data-parallel row: name and arguments, TP2 built)
ARCHITECTURES = {
    "mistral_tiny": (("fsdp2", []), True),  # also the checkpoint, HF export and resume rows
    "gemma3_tiny": (("fsdp2_ac_full", FULL_AC), True),  # sliding-window layers, QK-norm replicated over TP, tied head
    # QK-norm over the whole projection: its TP plan gathers q/k/v; its DDP row compiles each layer
    "olmo2_tiny": (("ddp2_compile", [*DDP, "--training.compile"]), True),
    "smollm3_tiny": (("fsdp2", []), True),  # layers without RoPE; its rows fine-tune on chat data (SFT below)
    "phi3_tiny": (("fsdp2_ac_op", OP_AC), True),  # fused qkv and gate_up projections (colwise_gather_output)
    "qwen3_moe_tiny": (("fsdp2", []), False),  # transformers' grouped experts; its TP plan's expert styles are refused
}
CHECKPOINTED = "mistral_tiny"
# SmolLM3's rows fine-tune on the shipped chat task with its tokenizer's template, examples packed whole and kept
# apart by block_causal documents (transformers' packed-sequence mask from the restarting positions)
SFT = [
    *("--model.tokenizer_path", "./tests/assets/sft/tokenizer", "--training.dataset", "sft_arith"),
    *("--training.dataset_format", "chat", "--training.loss_on", "assistant", "--training.overlong_examples"),
    *("truncate", "--model.attn_mask_type", "block_causal", "--model.positions_per_document"),
]
DATA = {"smollm3_tiny": SFT}
REFERENCES = [Row(f"hf_{f}_1proc", 1, 4) for f in ARCHITECTURES]
# Mistral's TP2 row compiles each layer (transformers' layers over TP's DTensor shards)
TP_COMPILED = "mistral_tiny"
ROWS = [Row(f"hf_{f}_{dp[0]}", 2, 2, dp[1]) for f, (dp, _) in ARCHITECTURES.items()] + [
    Row(f"hf_{f}_tp2_compile", 2, 4, ["--training.compile"], tp=2)
    if f == TP_COMPILED
    else Row(f"hf_{f}_tp2", 2, 4, tp=2)
    for f, (_, tp) in ARCHITECTURES.items()
    if tp
]
RESUMED = [Row(f"hf_{CHECKPOINTED}_resume_fsdp2", 2, 2, CHECKPOINT)]
# LoRA on the Mistral reference's export (its HF folder as the frozen base; the targets read from transformers'
# layers): a 1-rank reference, FSDP2 and TP2 (the adapters sharded like their linears; its PEFT export checked)
LORA_REFERENCE = [Row("hf_lora_1proc", 1, 4)]
LORA_ROWS = [Row("hf_lora_fsdp2", 2, 2), Row("hf_lora_tp2", 2, 4, CHECKPOINT, tp=2)]


def _flavor(row: Row) -> str:
    return next(f for f in ARCHITECTURES if row.name.startswith(f"hf_{f}_"))


def _run(row: Row, folder: str, extra: list[str] = (), expect_error: str | None = None) -> dict:
    argv = [*HF, "--model.flavor", _flavor(row), *DATA.get(_flavor(row), [])]
    argv += ["--training.batch_size", str(row.local_batch), *row.args()]
    compiled = "--training.compile" in argv  # the worker restarts after a compiled run, as the matrix's
    argv = [*argv, *extra, "--job.dump_folder", folder]
    return run_train_job(row.ngpu, argv, expect_error=expect_error, restart_after=compiled)


def _records(folder: str) -> list[dict]:
    return [r for r in read_metrics(folder) if "loss" in r]


def _close(a: float, b: float, what: str) -> None:
    assert abs(a - b) <= RTOL * max(abs(a), abs(b)), f"{what}: {a} vs {b} (rtol {RTOL})"


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("hf")
    out = {}
    for row in REFERENCES:
        folder = str(base / row.name)
        status = _run(row, folder, CHECKPOINT if _flavor(row) == CHECKPOINTED else [])
        assert status["ok"], status["error"]
        out[_flavor(row)] = folder
    return out


def test_references_learn(references):
    for flavor, folder in references.items():
        losses = [r["loss"] for r in _records(folder)]
        assert len(losses) == HF_STEPS and losses[-1] < losses[0], (flavor, losses)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_layout_at_parity(references, row, tmp_path):
    folder = str(tmp_path / row.name)
    status = _run(row, folder)
    assert status["ok"], status["error"]
    for a, b in zip(_records(references[_flavor(row)]), _records(folder), strict=True):
        _close(a["loss"], b["loss"], f"{row.name} step {a['step']} loss")
        _close(a["grad_norm"], b["grad_norm"], f"{row.name} step {a['step']} grad_norm")


def test_resume_on_fsdp2_continues_the_reference(references, tmp_path):
    row = RESUMED[0]
    folder = str(tmp_path / row.name)
    reference = references[CHECKPOINTED]
    shutil.copytree(os.path.join(reference, "checkpoint", "step-2"), os.path.join(folder, "checkpoint", "step-2"))
    status = _run(row, folder)
    assert status["ok"], status["error"]
    want, got = _records(reference)[2:], _records(folder)
    assert [r["step"] for r in got] == [3, 4]
    for a, b in zip(want, got, strict=True):
        _close(a["loss"], b["loss"], f"resumed on FSDP2, step {a['step']} loss")


def _lora_run(row: Row, folder: str, base: str) -> dict:
    argv = [*HF, "--model.flavor", "config", "--model.hf_config", base, "--checkpoint.initial_load_path", base]
    argv += ["--checkpoint.initial_load_in_hf", "--lora.enable", "--lora.rank", "4", "--lora.alpha", "8"]
    argv += ["--training.batch_size", str(row.local_batch), *row.args(), "--job.dump_folder", folder]
    return run_train_job(row.ngpu, argv)


@pytest.fixture(scope="module")
def lora_reference(references, tmp_path_factory) -> tuple[str, str]:
    """(the 1-rank LoRA run's folder, its base: the Mistral reference's HF export)."""
    base = os.path.join(references[CHECKPOINTED], "hf", f"step-{HF_STEPS}")
    folder = str(tmp_path_factory.mktemp("hf_lora") / LORA_REFERENCE[0].name)
    status = _lora_run(LORA_REFERENCE[0], folder, base)
    assert status["ok"], status["error"]
    return folder, base


@pytest.mark.parametrize("row", LORA_ROWS, ids=lambda r: r.name)
def test_lora_at_parity(lora_reference, row, tmp_path):
    """LoRA's losses and gradient norms (the adapters' only: the base is frozen) equal the 1-rank run's; step 1 is the
    base's own loss (B starts at zero), below the reference's first (the base is the reference after 4 steps)."""
    reference, base = lora_reference
    folder = str(tmp_path / row.name)
    status = _lora_run(row, folder, base)
    assert status["ok"], status["error"]
    want, got = _records(reference), _records(folder)
    assert want[0]["loss"] < _records(os.path.dirname(os.path.dirname(base)))[0]["loss"]
    for a, b in zip(want, got, strict=True):
        _close(a["loss"], b["loss"], f"{row.name} step {a['step']} loss")
        _close(a["grad_norm"], b["grad_norm"], f"{row.name} step {a['step']} grad_norm")
    if row.tp == 2:
        _check_peft_export(folder, base)


def _check_peft_export(folder: str, base: str) -> None:
    """The TP2 run's last step as a PEFT folder (checkpoint.last_save_in_hf) loads in peft over the base with the
    logits of the same checkpoint merged into its base (scripts/convert_to_hf.py --merge_lora's path)."""
    import json

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan.features.lora.hf_export import export_lora

    adapter = os.path.join(folder, "hf", f"step-{HF_STEPS}")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        assert sorted(json.load(f)["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj"] + [
            "q_proj",
            "up_proj",
            "v_proj",
        ]
    merged = os.path.join(folder, "merged")
    export_lora(os.path.join(folder, "checkpoint", f"step-{HF_STEPS}"), merged, merge=True, dtype=None)
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        before = plain(input_ids=tokens).logits
        got = peft.PeftModel.from_pretrained(plain, adapter).eval()(input_ids=tokens).logits
        want = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=tokens).logits
    assert (want - before).abs().max() > 1e-4, "4 steps of LoRA should move the logits"
    gap = (got - want).abs().max().item()
    assert gap <= 1e-5 * want.abs().max().item(), f"peft over the base vs merged: {gap}"


def test_export_loads_in_transformers_with_equal_logits(references):
    """The last step's HF export (checkpoint.last_save_in_hf) is an AutoModelForCausalLM folder whose logits equal
    the trainer's model loaded from the same step's DCP checkpoint, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan.checkpointing.common import load_model_weights
    from torchtitan.models.hf.model import HFArgs
    from torchtitan.models.hf.spec import SPEC

    folder = references[CHECKPOINTED]
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf", f"step-{HF_STEPS}"))
    weights, marker = load_model_weights(os.path.join(folder, "checkpoint", f"step-{HF_STEPS}"))
    args = HFArgs(**marker["model"]["args"])
    ours = SPEC.model_cls(args)
    ours.load_state_dict(weights)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(tokens), hf(input_ids=tokens).logits)


def test_convert_and_generate_the_runs_checkpoint(references, tmp_path, capsys):
    """The documented path after a run (docs/models.md): ``scripts/convert_to_hf.py`` on the Mistral reference's last
    checkpoint prints its one line (transformers 5 writes ``dtype``, not ``torch_dtype``), and ``scripts/generate.py
    --hf`` on what it wrote (model_type mistral, which no family of ours reads: transformers' class through this
    family) prints the greedy text transformers' ``generate`` gives on the same folder, the same prompt ids (the
    shipped tokenizer the run trained with: bos, then the text)."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan.datasets.tokenizer import build_tokenizer

    checkpoint, out = os.path.join(references[CHECKPOINTED], "checkpoint", f"step-{HF_STEPS}"), str(tmp_path / "hf")
    assert script_main("convert_to_hf")([checkpoint, out]) == 0
    assert capsys.readouterr().out == f"wrote {out}: 2 layers, hidden 64, float32\n"
    prompt, new_tokens = "def main(", 12
    assert script_main("generate")(["--hf", out, "--prompt", prompt, "--max_new_tokens", str(new_tokens)]) == 0
    tokenizer = build_tokenizer("./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken")
    ids = tokenizer.encode(prompt, bos=True, eos=False)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(out).generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=tokenizer.eos_id
        )[0, len(ids) :]
    assert capsys.readouterr().out == tokenizer.decode(want.tolist()) + "\n"


GPT2 = '{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 2048}'


def test_a_local_hf_folder_loads_sharded_and_exports_back_bit_exact(references, tmp_path):
    """The documented fine-tuning command (docs/models.md) on the reference's export, under FSDP2 with an lr of 1e-30
    (an update below every weight's last bit): each rank loads its shards of the folder (``model.flavor = 'config'``
    reads the same folder's config.json), and the last step's export holds the same tensors."""
    import torch
    from safetensors.torch import load_file

    source = os.path.join(references[CHECKPOINTED], "hf", f"step-{HF_STEPS}")
    folder = str(tmp_path / "from_hf")
    argv = [*HF, "--model.flavor", "config", "--model.hf_config", source, "--checkpoint.initial_load_path", source]
    argv += ["--checkpoint.initial_load_in_hf", "--checkpoint.enable_checkpoint", "--checkpoint.last_save_in_hf"]
    argv += ["--training.steps", "1", "--optimizer.lr", "1e-30", "--optimizer.weight_decay", "0"]
    argv += ["--training.batch_size", "2", "--job.dump_folder", folder]
    status = run_train_job(2, argv)
    assert status["ok"], status["error"]
    want = load_file(os.path.join(source, "model.safetensors"))
    got = load_file(os.path.join(folder, "hf", "step-1", "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--model.flavor", "qwen3_moe_tiny", "--training.tensor_parallel_degree", "2"],
            "its TP plan has styles not built",
        ),
        (
            ["--model.flavor", "config", "--model.hf_config", GPT2, "--training.tensor_parallel_degree", "2"],
            "transformers gives it no TP plan",
        ),
        (
            ["--experimental.pipeline_parallel_degree", "2"],
            "model.name = 'hf' with experimental.pipeline_parallel_degree",
        ),
        (["--model.flavor", "config"], "model.flavor = 'config' reads model.hf_config, which is unset"),
        (
            [
                *("--model.flavor", "config", "--model.hf_config", '{"model_type": "qwen3_5_text"}'),
                *("--model.attn_mask_type", "block_causal", "--model.positions_per_document"),
            ],
            "are not attention, and their state would cross the packed documents",
        ),
        (
            ["--model.flavor", "config", "--model.hf_config", '{"model_type": "t5"}'],
            "is not a causal language model in transformers",
        ),
        (
            ["--model.flavor", "config", "--model.hf_config", '{"model_type": "llama", "auto_map": {"x": "y"}}'],
            "needs remote code",
        ),
    ],
)
def test_refused_in_one_line(flags, expected):
    from torchtitan.config.manager import JobConfig
    from torchtitan.preflight import run_preflight

    config = JobConfig.parse_args([*HF, *flags])
    with pytest.raises((ValueError, NotImplementedError)) as info:
        run_preflight(config, 2, this_machine=False)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_generate_py_on_a_transformers_class_prints_no_torchao_import_notes(tmp_path):
    """``scripts/generate.py --hf`` on a folder no family of ours reads (Qwen2: transformers' class through this
    family), as a user runs it: transformers' model classes import torchao, whose notes on its kernels that did not
    load and torch's pytree deprecation of its enums used to come before the answer (issue 84, item 11). The answer
    is the output; nothing of torchao's is on stderr."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2304,  # the shipped tokenizer's, generate.py's default for a folder without one
        max_position_embeddings=256,
    )
    folder = str(tmp_path / "qwen2")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    cmd = [sys.executable, "scripts/generate.py", "--hf", folder, "--prompt", "def main(", "--max_new_tokens", "3"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("\n") == 1, run.stdout
    for note in ("Failed to load", "_C_mxfp8", "register_constant()", "torch/utils/_pytree.py"):
        assert note not in run.stderr, run.stderr[-3000:]
