"""LoRA through the trainer (worker-pool jobs): loss parity per layout, a frozen base, adapter-only state.

* Parity: llama3 and qwen3 at the tiny flavor with adapters (rank 4) on every block linear; FSDP2 (with full /
  selective-op activation checkpointing riding on it), TP2 (each adapter sharded like its base linear:
  lora/tensor_parallel.py), PP2 1F1B and FSDP2 with gradient accumulation 2, and CP2 (llama3), against one process's LoRA run, loss within the matrix's RTOL (1e-5) and grad norm within
  GRAD_NORM_RTOL. LoRA runs are compared with LoRA runs: their losses are not the full fine-tuning rows'.
* The one-process run's losses fall; with lora.enable the step-1 loss equals the full run's exactly (B = 0).
* TP2, in the pool: after 6 steps every base weight is bit-identical to its initial value, every
  adapter moved, and the optimizer holds state for the adapters only.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from tests.support.lora import check_lora_parity
from tests.support.matrix import RTOL, MatrixLaunches, Row
from tests.support.pool import run_in_pool
from tests.support.rows import LORA, LORA_LLAMA_REFERENCE, LORA_LLAMA_ROWS, LORA_QWEN3_REFERENCE, LORA_QWEN3_ROWS
from tests.support.runs import GLOBAL_BATCH, read_metrics, tokenizer_n_words, train, trainer_argv
from tests.support.scripts import script_module

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]


PAIRS = [(r, LORA_LLAMA_REFERENCE) for r in LORA_LLAMA_ROWS] + [(r, LORA_QWEN3_REFERENCE) for r in LORA_QWEN3_ROWS]


@pytest.mark.parametrize(("row", "reference"), PAIRS, ids=[r.name for r, _ in PAIRS])
def test_lora_loss_parity(row: Row, reference: Row, matrix: MatrixLaunches):
    check_lora_parity(row, reference, matrix)


def test_lora_reference_learns_from_the_base(matrix: MatrixLaunches, reference: dict[str, list[float]]):
    lora = matrix.losses(LORA_LLAMA_REFERENCE)["loss"]
    assert lora[0] == reference["loss"][0], "step 1 (B = 0) should be the base model's loss exactly"
    assert lora[-1] < lora[0] - 0.1, f"LoRA loss did not fall: {lora}"
    assert lora[-1] != reference["loss"][-1]  # it trained something else than the full model


def _frozen_base_job(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train 6 steps on these ranks; what moved (whole tensors) and what the optimizer holds."""
    import torch
    from torch.distributed.tensor import DTensor

    from torchtitan.config.manager import JobConfig
    from torchtitan.train import Trainer

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()  # a Replicate one is a view

    trainer = Trainer(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank)
    try:
        model = trainer.model_parts[0]
        before = {n: full(p) for n, p in model.named_parameters()}
        trainer.train()
        moved = {n for n, p in model.named_parameters() if not torch.equal(full(p), before[n])}
        names = {p: n for n, p in model.named_parameters()}
        with_state = {names[p] for p, s in trainer.optimizer.state.items() if s}
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        return {"moved": moved, "with_state": with_state, "frozen": frozen, "all": set(before)}
    finally:
        trainer.close()


def test_lora_trains_only_the_adapters(tmp_path):
    """Under TP2 (torch's SequenceParallel re-creates the norms' weights trainable; they must stay frozen)."""
    overrides = [*LORA, "--training.batch_size", str(GLOBAL_BATCH), "--training.tensor_parallel_degree", "2"]
    results = run_in_pool(_frozen_base_job, 2, trainer_argv(overrides, str(tmp_path / "frozen")))
    for result in results:
        adapters = {n for n in result["all"] if ".lora_a." in n or ".lora_b." in n}
        assert len(adapters) == 4 * 7 * 2  # 4 layers x 7 linears x (A, B)
        assert result["frozen"] == result["all"] - adapters
        assert result["moved"] == adapters, sorted(result["moved"] ^ adapters)[:5]
        assert result["with_state"] == adapters


# ---- adapter-only checkpoints ----

CKPT = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", "3"]


def _train(ngpu: int, folder: str, args: list[str]) -> str:
    result = train(ngpu, folder, args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def _losses(folder: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r}


def _tensor_bytes(path: str) -> dict[str, int]:
    """Bytes of the tensors a DCP checkpoint holds, per top-level part (model, optimizer, ...)."""
    from torchtitan.checkpointing.common import read_metadata

    out: dict[str, int] = {}
    for key, md in read_metadata(path).state_dict_metadata.items():
        if hasattr(md, "size"):
            part = key.split(".", 1)[0]
            out[part] = out.get(part, 0) + math.prod(md.size) * md.properties.dtype.itemsize
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict[str, str]:
    """A 2-rank FSDP2 LoRA run from a seed-7 base (checkpoint.initial_load_path; not the run's seed-42 init),
    saving at steps 3 and 6 and exporting its last step as a PEFT folder; and its step-3 checkpoint resumed."""
    tmp = tmp_path_factory.mktemp("lora_ckpt")
    seed = str(tmp / "seed")
    _train(1, seed, ["--checkpoint.enable_checkpoint", "--checkpoint.create_seed_checkpoint", "--training.seed", "7"])
    base = os.path.join(seed, "checkpoint", "step-0")
    run = [*LORA, *CKPT, "--training.batch_size", "4", "--checkpoint.initial_load_path", base]
    full, resumed = str(tmp / "full"), str(tmp / "resumed")
    full_log = _train(2, full, [*run, "--checkpoint.last_save_in_hf"])
    shutil.copytree(os.path.join(full, "checkpoint", "step-3"), os.path.join(resumed, "checkpoint", "step-3"))
    log = _train(2, resumed, run)
    hf_base = str(tmp / "hf_base")
    from torchtitan.checkpointing.hf.convert import export_to_hf

    export_to_hf(base, hf_base)
    return {
        "tmp": str(tmp),
        "base": base,
        "full": full,
        "full_log": full_log,
        "resumed": resumed,
        "resumed_log": log,
        "hf_base": hf_base,
    }


def test_lora_start_summary_names_the_adapters_and_the_initial_weights(lora_run):
    """Issue 56, item 5: the summary names LoRA, its rank, targets and trainable share, and says the base is initial
    weights (not a resume) on the first start and a resume of the adapters on the base after it."""
    adapters = 4 * (4 * 4 * (64 + 64) + 3 * 4 * (64 + 256))  # 4 layers: rank 4 on wq..wo (64 x 64), w1..w3 (64 x 256)
    total = 557_632 + adapters  # the tiny flavor on the shipped tokenizer, and its adapters
    share = f"{adapters / total:.2%} of parameters trainable ({adapters:,} of {total:,})"
    full, resumed, base = lora_run["full_log"], lora_run["resumed_log"], lora_run["base"]
    assert f"trains      LoRA rank 4 on wq,wk,wv,wo,w1,w2,w3: {share}\n" in full, full[-3000:]
    assert f"start       initial weights from {base}\n" in full, full[-3000:]
    step3 = os.path.join(lora_run["resumed"], "checkpoint", "step-3")
    assert f"start       resumed from step 3 ({step3}); base: initial weights from {base}\n" in resumed, resumed[-3000:]


def test_lora_checkpoint_holds_adapters_and_resumes_bit_exact_on_the_base_it_loads(lora_run):
    """The base comes from checkpoint.initial_load_path on the first start and again on resume; the checkpoint
    holds the adapters, their optimizer state, data and step."""
    full, base = lora_run["full"], lora_run["base"]
    assert "resumed from step 3" in lora_run["resumed_log"]
    assert "started from checkpoint weights" in lora_run["resumed_log"]
    want, got = _losses(full), _losses(lora_run["resumed"])
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]

    from torchtitan.checkpointing.common import read_metadata

    step3 = os.path.join(full, "checkpoint", "step-3")
    keys = set(read_metadata(step3).state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_a." in k or ".lora_b." in k for k in model_keys), sorted(model_keys)[:3]
    optim_keys = {k for k in keys if k.startswith("optimizer.state.")}
    assert optim_keys and all(".lora_a." in k or ".lora_b." in k for k in optim_keys), sorted(optim_keys)[:3]
    assert any(k.startswith("dataloader.") for k in keys) and "train_state.step" in keys
    sizes, seed_sizes = _tensor_bytes(step3), _tensor_bytes(base)
    adapters = 4 * (4 * 4 * (64 + 64) + 3 * 4 * (64 + 256))  # 4 layers: rank 4 on wq..wo (64 x 64), w1..w3 (64 x 256)
    assert sizes["model"] == adapters * 4  # fp32
    assert sizes["optimizer"] == 2 * sizes["model"] + 56 * 4  # AdamW exp_avg, exp_avg_sq and a step per adapter
    ratio = (sizes["model"] + sizes["optimizer"]) / (3 * seed_sizes["model"])
    print(f"LoRA checkpoint: {sizes}; vs a full run's model + AdamW state: {ratio:.4f}")
    assert ratio < 0.05

    # the same base from its Hugging Face export: the same step-1 loss (B = 0: the base's own)
    from_hf = os.path.join(lora_run["tmp"], "from_hf")
    hf_run = [*LORA, "--training.batch_size", "8", "--training.steps", "1"]
    _train(
        1, from_hf, [*hf_run, "--checkpoint.initial_load_path", lora_run["hf_base"], "--checkpoint.initial_load_in_hf"]
    )
    assert abs(_losses(from_hf)[1] - want[1]) <= RTOL * want[1], (_losses(from_hf), want)


def _adapters_job(rank: int, world_size: int, argv: list[str]) -> dict:
    """Build the trainer (no step) and return its adapters as whole tensors."""
    from torch.distributed.tensor import DTensor

    from torchtitan.config.manager import JobConfig
    from torchtitan.train import Trainer

    trainer = Trainer(JobConfig.parse_args(argv, world_size=world_size), world_size=world_size, rank=rank)
    try:
        return {
            n: (p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for n, p in trainer.model_parts[0].named_parameters()
            if ".lora_" in n
        }
    finally:
        trainer.close()


def test_peft_export_loads_in_peft_merges_and_loads_back(lora_run):
    """checkpoint.last_save_in_hf wrote a PEFT folder: peft on transformers (built from our HF export of the base)
    gives our logits; --merge_lora's full model too, and generate.py --adapter's; the folder loads back into the
    trainer (lora.adapter_path) as the very adapters of step 6, sharded under TP2."""
    peft = pytest.importorskip("peft")
    import torch
    import transformers

    from torchtitan.checkpointing.common import load_model_weights

    convert_to_hf, generate = script_module("convert_to_hf"), script_module("generate")

    peft_dir = os.path.join(lora_run["full"], "hf", "step-6")
    step6 = os.path.join(lora_run["full"], "checkpoint", "step-6")
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["r"] == 4 and config["lora_alpha"] == 32 and config["base_model_name_or_path"] == lora_run["base"]
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    cpu = torch.device("cpu")
    tokens = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = generate.load_model(step6, None, 64, tokenizer_n_words(), cpu)  # our model: the recorded base + the adapters
    hf = transformers.AutoModelForCausalLM.from_pretrained(lora_run["hf_base"], dtype=torch.float32).eval()
    merged_dir = os.path.join(lora_run["tmp"], "merged")
    assert convert_to_hf.main([step6, merged_dir, "--merge_lora"]) == 0
    from torchtitan.checkpointing.hf.convert import export_to_hf  # whole models only: the adapters' scope is refused

    with pytest.raises(ValueError, match=r"holds part of a model \(its lora run's trained keys\)"):
        export_to_hf(step6, os.path.join(lora_run["tmp"], "not_written"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with_adapter = generate.load_model(None, lora_run["hf_base"], 64, tokenizer_n_words(), cpu, adapter=peft_dir)
    with torch.no_grad():
        want = ours(tokens)
        gaps = {"base": (hf(tokens).logits - want).abs().max().item()}
        gaps["peft"] = (peft.PeftModel.from_pretrained(hf, peft_dir).eval()(tokens).logits - want).abs().max().item()
        gaps["merged"] = (merged(tokens).logits - want).abs().max().item()
        gaps["generate --adapter"] = (with_adapter(tokens) - want).abs().max().item()
    print("logit gaps to ours:", gaps)
    assert gaps["base"] > 1e-3 and max(v for k, v in gaps.items() if k != "base") <= 1e-5, gaps

    argv = trainer_argv(
        [
            *LORA,
            "--training.batch_size",
            "8",
            "--training.tensor_parallel_degree",
            "2",
            "--lora.adapter_path",
            peft_dir,
        ],
        os.path.join(lora_run["tmp"], "from_peft"),
    )
    loaded = run_in_pool(_adapters_job, 2, argv)[0]
    saved = {k: v for k, v in load_model_weights(step6)[0].items() if ".lora_" in k}
    assert set(loaded) == set(saved) and all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_merge_lora_without_adapters_and_a_seeded_base_are_one_line(lora_run, capsys):
    convert_to_hf = script_module("convert_to_hf")
    out = os.path.join(lora_run["tmp"], "not_written")
    assert convert_to_hf.main([lora_run["base"], out, "--merge_lora"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds no LoRA adapters" in err, err
