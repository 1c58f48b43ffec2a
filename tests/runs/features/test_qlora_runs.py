"""QLoRA (``lora.quantize_base = 'nf4'``) through the trainer (worker-pool jobs), on the debug flavor: its targets
hold whole NF4 groups (64 x 256 elements), the tiny flavor's do not (tests/unit/test_qlora.py has the refusal).

* Parity: FSDP2 x 2 (with full AC riding on it) against one process's QLoRA run, loss within the matrix's RTOL and
  grad norm within GRAD_NORM_RTOL: every rank quantizes the whole weight and keeps its chunk, so both layouts hold
  the same NF4 bytes (checked directly, chunks gathered; the NF4 shards are what FSDP all-gathers).
* One process, 30 steps: the loss falls; the NF4 base (codes, scales, factors) is bit-identical after training,
  only the adapters moved and have optimizer state, the step-30 checkpoint holds adapters only, its merges give the
  trained logits, its PEFT export works, and the step-15 checkpoint resumes bit-exact.
* The estimator, one process: QLoRA's estimate < LoRA's < full fine-tuning's on the same config, and QLoRA's
  estimate within 5% of torch's tracker on the real step (measured: equal).
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.matrix import AC_FULL, GRAD_NORM_RTOL, RTOL, MatrixLaunches, Row, check_grad_norms
from tests.support.pool import run_in_pool
from tests.support.rows import LORA
from tests.support.runs import GLOBAL_BATCH, read_metrics, train, trainer_argv

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]
pytest.importorskip("torchao")

QLORA = [*LORA, "--lora.quantize_base", "nf4", "--model.flavor", "debugmodel"]
QLORA_REFERENCE = Row("qlora_llama3_1proc", 1, GLOBAL_BATCH, QLORA)
QLORA_ROWS = [QLORA_REFERENCE, Row("qlora_llama3_fsdp2", 2, 4, [*QLORA, *AC_FULL])]
# the 30-step run and the estimates: PEFT's classic targets only (a quarter of the NF4 dequantizations per step)
QV = ["--lora.target_modules", "q_proj,v_proj"]


def test_qlora_fsdp2_equals_one_process(matrix: MatrixLaunches):
    for row in QLORA_ROWS:  # both quantized: 8 layers x 7 linears
        assert "56 frozen base linears stored as NF4" in matrix.run(row), row.name
    got, want = matrix.losses(QLORA_ROWS[1]), matrix.losses(QLORA_REFERENCE)
    gaps = [abs(g - w) / abs(w) for g, w in zip(got["loss"], want["loss"], strict=True)]
    print("qlora_llama3_fsdp2 gap to one process", [f"{g:.2e}" for g in gaps])
    assert max(gaps) <= RTOL, f"{got['loss']} vs single-process {want['loss']}"
    check_grad_norms("qlora_llama3_fsdp2", got["grad_norm"], want["grad_norm"], GRAD_NORM_RTOL)


def _nf4_bytes_job(rank: int, world_size: int, argv: list[str]) -> dict:
    """Build the trainer (no step); every NF4 base weight's codes, scales, factors and mean, whole (chunks gathered)."""
    import torch
    import torch.distributed as dist

    from torchtitan.config.manager import JobConfig
    from torchtitan.features.lora.quantize import is_nf4
    from torchtitan.train import Trainer

    trainer = Trainer(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank)
    try:
        out = {}
        for name, p in trainer.model_parts[0].named_parameters():
            if is_nf4(p):
                parts = _nf4_parts(getattr(p, "_local_tensor", p))
                chunks = [parts]
                if world_size > 1:
                    chunks = [None] * world_size
                    dist.all_gather_object(chunks, parts)
                out[name] = [torch.cat([c[i] for c in chunks]) for i in range(3)] + [chunks[0][3]]
                assert all(torch.equal(c[3], chunks[0][3]) for c in chunks)  # one mean per tensor, on every rank
        return out
    finally:
        trainer.close()


def test_fsdp2_holds_the_one_process_nf4_bytes(tmp_path):
    """The base is quantized whole on every rank and chunked: the NF4 bytes do not depend on the layout."""
    import torch

    args = [*QLORA, "--training.batch_size", "4"]
    one = run_in_pool(_nf4_bytes_job, 1, trainer_argv(args, str(tmp_path / "one")))[0]
    two = run_in_pool(_nf4_bytes_job, 2, trainer_argv(args, str(tmp_path / "two")))[0]
    assert len(one) == 8 * 7 and set(one) == set(two)
    assert all(torch.equal(a, b) for k in one for a, b in zip(one[k], two[k], strict=True))


def _nf4_parts(t) -> list:
    return [
        getattr(t, n).clone() for n in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
    ]


def TOKENS():  # noqa: N802 (a constant, made where it is used)
    import torch

    return torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))


def _train_job(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train; what moved, what is NF4, what the optimizer holds."""
    import torch

    from torchtitan.config.manager import JobConfig
    from torchtitan.features.lora.quantize import is_nf4
    from torchtitan.train import Trainer

    trainer = Trainer(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank)
    try:
        model = trainer.model_parts[0]
        params = dict(model.named_parameters())
        nf4 = {n for n, p in params.items() if is_nf4(p)}
        before = {n: _nf4_parts(p) if n in nf4 else [p.detach().clone()] for n, p in params.items()}
        trainer.train()
        after = {n: _nf4_parts(p) if n in nf4 else [p.detach()] for n, p in model.named_parameters()}
        moved = {n for n in before if not all(torch.equal(a, b) for a, b in zip(before[n], after[n], strict=True))}
        with_state = {n for n, p in params.items() if trainer.optimizer.state.get(p)}
        with torch.no_grad():
            logits = model.eval()(TOKENS())
        return {"moved": moved, "with_state": with_state, "nf4": nf4, "all": set(params), "logits": logits}
    finally:
        trainer.close()


def test_qlora_trains_30_steps_on_a_bit_identical_nf4_base(tmp_path):
    """From a seed-7 base (checkpoint.initial_load_path); the merges of its step-30 checkpoint (generate.py's, and
    convert_to_hf.py --merge_lora's HF model) dequantize that base, so their logits are the trained model's; its
    step-15 checkpoint resumes bit-exact."""
    seed, folder = str(tmp_path / "seed"), str(tmp_path / "qlora30")
    made = train(
        1,
        seed,
        ["--model.flavor", "debugmodel", "--checkpoint.enable_checkpoint", "--training.seed", "7"]
        + ["--checkpoint.create_seed_checkpoint"],
    )
    assert made.returncode == 0, made.stderr[-2000:]
    base = os.path.join(seed, "checkpoint", "step-0")
    overrides = [*QLORA, *QV, "--training.steps", "30", "--training.batch_size", "4", "--training.warmup_steps", "3"]
    overrides += [
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "15",
        "--checkpoint.initial_load_path",
        base,
    ]
    result = run_in_pool(_train_job, 1, trainer_argv(overrides, folder))[0]
    adapters = {n for n in result["all"] if ".lora_a." in n or ".lora_b." in n}
    assert len(adapters) == 8 * 2 * 2 and len(result["nf4"]) == 8 * 2  # 8 layers x wq, wv (x A, B)
    assert result["moved"] == adapters and result["with_state"] == adapters, sorted(result["moved"] ^ adapters)[:5]
    losses = [r["loss"] for r in read_metrics(folder) if "loss" in r]
    print(f"QLoRA 30 steps: {losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f})")
    assert len(losses) == 30 and max(losses[-5:]) < losses[0] - 0.3, losses

    from torchtitan.checkpointing.common import read_metadata

    keys = set(read_metadata(os.path.join(folder, "checkpoint", "step-30")).state_dict_metadata)
    model_keys = {k for k in keys if k.startswith(("model.", "optimizer.state."))}
    assert model_keys and all(".lora_a." in k or ".lora_b." in k for k in model_keys), sorted(model_keys)[:3]
    _check_merges(os.path.join(folder, "checkpoint", "step-30"), result["logits"], str(tmp_path / "merged"))
    _check_peft_export(os.path.join(folder, "checkpoint", "step-30"), base, result["logits"], str(tmp_path))

    # resume at step 15: the base is read and quantized again (the same bytes), the adapters come from the checkpoint
    resumed = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(folder, "checkpoint", "step-15"), os.path.join(resumed, "checkpoint", "step-15"))
    run = train(1, resumed, overrides)
    assert run.returncode == 0 and "resumed from step 15" in run.stderr, run.stderr[-2000:]
    again = [r["loss"] for r in read_metrics(resumed) if "loss" in r]
    assert again == losses[15:], (again, losses[15:])


def _check_merges(step: str, want, merged_dir: str) -> None:
    import torch
    import transformers

    from tests.support.runs import tokenizer_n_words
    from tests.support.scripts import script_module

    convert_to_hf, generate = script_module("convert_to_hf"), script_module("generate")
    ours = generate.load_model(step, None, 64, tokenizer_n_words(), torch.device("cpu"))
    assert convert_to_hf.main([step, merged_dir, "--merge_lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        gaps = {"generate": (ours(TOKENS()) - want).abs().max().item()}
        gaps["--merge_lora"] = (merged(TOKENS()).logits - want).abs().max().item()
    print("QLoRA merges, logit gaps to the trained NF4 model:", gaps)
    assert max(gaps.values()) <= 1e-5, gaps


def _check_peft_export(step: str, base: str, want, tmp: str) -> None:
    """The PEFT folder of a QLoRA checkpoint is LoRA's; generate.py --adapter merges it into the full-precision base
    it is given, which is not the NF4 base the adapters trained on: near the trained logits, not equal."""
    import json

    import torch

    from tests.support.runs import tokenizer_n_words
    from tests.support.scripts import script_module
    from torchtitan.checkpointing.hf.convert import export_to_hf

    peft_dir, hf_base = os.path.join(tmp, "peft"), os.path.join(tmp, "hf_base")
    assert script_module("convert_to_hf").main([step, peft_dir]) == 0
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    export_to_hf(base, hf_base)
    model = script_module("generate").load_model(
        None, hf_base, 64, tokenizer_n_words(), torch.device("cpu"), adapter=peft_dir
    )
    with torch.no_grad():
        rel = ((model(TOKENS()) - want).norm() / want.norm()).item()
    print(f"generate.py --adapter on the fp32 base vs the trained NF4 model: relative logit gap {rel:.4f}")
    assert 1e-5 < rel < 0.05


def _tracked_peak_job(rank: int, world_size: int, argv: list[str]) -> int:
    from torchtitan.config.manager import JobConfig
    from torchtitan.estimation.estimate import estimate_rank
    from torchtitan.estimation.fake_trainer import resolve_vocab

    config = JobConfig.parse_args(argv)
    return estimate_rank(config, 1, 0, resolve_vocab(config)[0], fake=False).peak


def test_qlora_estimate_matches_the_tracker_and_is_below_lora_and_full():
    from torchtitan.config.manager import JobConfig
    from torchtitan.estimation.estimate import estimate_memory

    base = [*trainer_argv(["--model.flavor", "debugmodel", "--training.batch_size", "4"], "unused")[:-2]]
    base += ["--validation.enabled", "false"]
    peaks = {
        name: estimate_memory(JobConfig.parse_args([*base, *extra]), 1).peak
        for name, extra in (("qlora", [*QLORA, *QV]), ("lora", [*LORA, *QV]), ("full", []))
    }
    real = run_in_pool(_tracked_peak_job, 1, [*base, *QLORA, *QV])[0]
    mib = {k: round(v / 2**20, 2) for k, v in peaks.items()}
    print(f"estimates (MiB): {mib}; QLoRA's real step (tracker): {real / 2**20:.2f} MiB")
    assert peaks["qlora"] < peaks["lora"] < peaks["full"]
    assert abs(peaks["qlora"] - real) <= 0.05 * real
