"""``model.name = "hf"``: transformers' own causal LMs through the trainer (worker-pool jobs), tiny random configs.

Per architecture a 1-rank reference, a data-parallel row and (where its TP plan is built) TP2 at 2 ranks, at the
matrix's rtol; the options ride on the data-parallel rows (full AC on Gemma 3's FSDP2 row, selective op AC on
Phi-3's, DDP for OLMo 2). Mistral's reference checkpoints and exports to HF: the export loads in transformers with the
built model's logits, and a resume on FSDP2 continues the reference's losses. The logits of every built model equal
transformers' own class with the same weights (tests/unit/test_hf_model.py, in process).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.integration_tests import Row, read_metrics
from tests.pool import run_train_job

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2, 4)]

RTOL = 1e-5  # the matrix's
STEPS = 4
HF = [
    *("--job.config_file", "./train_configs/hf_debug.toml", "--training.steps", str(STEPS), "--metrics.log_freq", "1"),
    *("--training.seq_len", "64", "--training.warmup_steps", "0", "--optimizer.lr", "1e-2"),
]
CHECKPOINT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf"]
FULL_AC = ["--activation_checkpoint.mode", "full"]
OP_AC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
DDP = ["--training.data_parallel_shard_degree", "1", "--training.data_parallel_replicate_degree", "2"]
HSDP = ["--training.data_parallel_shard_degree", "2", "--training.data_parallel_replicate_degree", "2"]
# flavor -> (its data-parallel row: name and arguments, TP2 built)
ARCHITECTURES = {
    "mistral_tiny": (("fsdp2", []), True),  # also the checkpoint, HF export and resume rows
    "gemma3_tiny": (("fsdp2_ac_full", FULL_AC), True),  # sliding-window layers, QK-norm replicated over TP, tied head
    "olmo2_tiny": (("ddp2", DDP), True),  # QK-norm over the whole projection: its TP plan gathers q/k/v
    "smollm3_tiny": (("fsdp2", []), True),  # layers without RoPE
    "phi3_tiny": (("fsdp2_ac_op", OP_AC), True),  # fused qkv and gate_up projections (colwise_gather_output)
    "qwen3_moe_tiny": (("fsdp2", []), False),  # transformers' grouped experts; its TP plan's expert styles are refused
}
CHECKPOINTED = "mistral_tiny"
REFERENCES = [Row(f"hf_{f}_1proc", 1, 4) for f in ARCHITECTURES]
ROWS = [Row(f"hf_{f}_{dp[0]}", 2, 2, dp[1]) for f, (dp, _) in ARCHITECTURES.items()] + [
    Row(f"hf_{f}_tp2", 2, 4, tp=2) for f, (_, tp) in ARCHITECTURES.items() if tp
]
RESUMED = [Row(f"hf_{CHECKPOINTED}_resume_fsdp2", 2, 2, CHECKPOINT)]


def _flavor(row: Row) -> str:
    return next(f for f in ARCHITECTURES if row.name.startswith(f"hf_{f}_"))


def _run(row: Row, folder: str, extra: list[str] = (), expect_error: str | None = None) -> dict:
    argv = [*HF, "--model.flavor", _flavor(row), "--training.batch_size", str(row.local_batch), *row.args()]
    return run_train_job(row.ngpu, [*argv, *extra, "--job.dump_folder", folder], expect_error=expect_error)


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
        assert len(losses) == STEPS and losses[-1] < losses[0], (flavor, losses)


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


def test_export_loads_in_transformers_with_equal_logits(references):
    """The last step's HF export (checkpoint.last_save_in_hf) is an AutoModelForCausalLM folder whose logits equal
    the trainer's model loaded from the same step's DCP checkpoint, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    from torchtitan.checkpointing.common import load_model_weights
    from torchtitan.models.hf.model import HFArgs
    from torchtitan.models.hf.spec import SPEC

    folder = references[CHECKPOINTED]
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf", f"step-{STEPS}"))
    weights, marker = load_model_weights(os.path.join(folder, "checkpoint", f"step-{STEPS}"))
    args = HFArgs(**marker["model"]["args"])
    ours = SPEC.model_cls(args)
    ours.load_state_dict(weights)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(tokens), hf(input_ids=tokens).logits)


GPT2 = '{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 2048}'


def test_a_local_hf_folder_loads_sharded_and_exports_back_bit_exact(references, tmp_path):
    """The documented fine-tuning command (docs/models.md) on the reference's export, under FSDP2 with an lr of 1e-30
    (an update below every weight's last bit): each rank loads its shards of the folder (``model.flavor = 'config'``
    reads the same folder's config.json), and the last step's export holds the same tensors."""
    import torch
    from safetensors.torch import load_file

    source = os.path.join(references[CHECKPOINTED], "hf", f"step-{STEPS}")
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
