"""Fine-tuning from Hugging Face and back (issue 19's acceptance):

a ``LlamaForCausalLM`` saved by transformers (random init, sharded safetensors with an index) is the
starting point of a run with ``checkpoint.initial_load_in_hf``; 20 FSDP2 steps on 2 ranks; the last
checkpoint is exported with ``checkpoint.last_save_in_hf``; transformers loads the export.

Checked:
- the first step's loss (our forward on the loaded shards) equals transformers' loss of the same model
  on the same global batch (fp32; only reduction order differs: the matrix's RTOL);
- the same holds for TP2, FSDP2 x TP2 (4 ranks) and PP2 starts (row- and column-sharded weights,
  FSDP over TP; each stage reads only its own layers), and for a Qwen3-MoE model under EP2 (per-expert HF tensors stacked, then cut by expert);
- the export loads in transformers with no missing or unexpected weight, holds exactly the weights of
  the final DCP checkpoint (through the adapter), and its loss on the first batch is below the
  starting model's (it is the trained model).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.support.distributed import run_distributed
from tests.support.hf import hf_logits, save_random_hf_model
from tests.support.matrix import RTOL
from tests.support.runs import ROOT
from torchtitan.config.manager import JobConfig
from torchtitan.train import run_job

pytestmark = [pytest.mark.distributed, pytest.mark.pool(2, 4)]

STEPS = 20
COMMON = [
    "--training.seq_len",
    "64",
    "--training.warmup_steps",
    "2",
    "--optimizer.lr",
    "1e-3",
    "--training.mixed_precision_param",
    "float32",
    "--training.seed",
    "5",
    "--training.deterministic",
    "--metrics.log_freq",
    "1",
    "--activation_checkpoint.mode",
    "none",
]
FAMILIES = {"llama": "train_configs/debug_model.toml", "qwen3_moe": "train_configs/qwen3_moe_debug_model.toml"}
# name -> (family, steps, local batch per dp rank, overrides); global batch 4 everywhere
LAYOUTS = {
    "fsdp2": ("llama", STEPS, 2, ["--training.data_parallel_shard_degree", "2", "--checkpoint.last_save_in_hf"]),
    "tp2": ("llama", 1, 4, ["--training.tensor_parallel_degree", "2"]),
    "pp2": (
        "llama",
        1,
        4,
        ["--experimental.pipeline_parallel_degree", "2", "--experimental.pipeline_parallel_microbatches", "2"],
    ),
    "moe_ep2": (
        "qwen3_moe",
        1,
        2,
        ["--training.data_parallel_shard_degree", "2", "--experimental.expert_parallel_degree", "2"],
    ),
}


# llama at the parity flavor (dim 64, 4 layers): what is checked (a sharded HF start read under each layout, the step-1
# loss against transformers', the export) does not depend on the width, and its 20 FSDP2 steps were most of this file's
# time at the debug flavor (dim 256, 8 layers). Qwen3-MoE keeps its config's flavor, whose aux-loss balancing has an HF
# counterpart (the tiny MoE flavor balances by expert bias, which has none)
FLAVORS = {"llama": ["--model.flavor", "debugmodel_tiny"], "qwen3_moe": []}


def _base(family: str) -> list[str]:
    return ["--job.config_file", FAMILIES[family], *FLAVORS[family], *COMMON]


def _argv(hf_dir: str, folder: str, family: str, steps: int, batch: int, overrides: list[str]) -> list[str]:
    return [
        *_base(family),
        "--training.steps",
        str(steps),
        "--training.batch_size",
        str(batch),
        "--job.dump_folder",
        folder,
        "--checkpoint.enable_checkpoint",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.initial_load_path",
        hf_dir,
        "--checkpoint.initial_load_in_hf",
        *overrides,
    ]


# 4 ranks: FSDP over TP (both shard dim 0 of the column-parallel weights)
LAYOUTS_4 = {
    "fsdp2_tp2": (
        "llama",
        1,
        2,
        ["--training.data_parallel_shard_degree", "2", "--training.tensor_parallel_degree", "2"],
    )
}


def _ranks(rank: int, world_size: int, base: str) -> None:
    os.chdir(ROOT)
    for name, (family, steps, batch, overrides) in (LAYOUTS if world_size == 2 else LAYOUTS_4).items():
        hf_dir = os.path.join(base, f"hf_{family}")
        run_job(
            JobConfig.parse_args(_argv(hf_dir, os.path.join(base, name), family, steps, batch, overrides)),
            world_size=world_size,
            rank=rank,
        )


def _losses(folder: str) -> list[float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _hf_start(family: str, folder: str) -> None:
    """A random-init HF model of the run's flavor (``_base``), saved by transformers in shards."""
    save_random_hf_model(_base(family), folder)


def _first_batch(family: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first global batch (4 sequences) of the runs: data order depends on the global batch only."""
    from torchtitan.train import Trainer

    config = JobConfig.parse_args([*_base(family), "--training.steps", "1", "--training.batch_size", "4"])
    trainer = Trainer(config, world_size=1, rank=0)
    batch = trainer.next_batches(iter(trainer.data_loader))[0]
    return batch.inputs, batch.labels


def _hf_loss(folder: str, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    logits = hf_logits(folder, inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()


def test_hf_model_fine_tuned_under_fsdp2_and_exported_back(tmp_path):
    from safetensors.torch import load_file

    from torchtitan.checkpointing.common import load_model_weights
    from torchtitan.models.llama.hf_adapter import ADAPTER as hf_adapter

    os.chdir(ROOT)
    for family in FAMILIES:
        _hf_start(family, str(tmp_path / f"hf_{family}"))
    assert os.path.isfile(str(tmp_path / "hf_llama" / "model.safetensors.index.json"))  # the sharded layout is read
    run_distributed(_ranks, 2, str(tmp_path), timeout_s=600)
    run_distributed(_ranks, 4, str(tmp_path), timeout_s=600)

    batches = {family: _first_batch(family) for family in FAMILIES}
    start_loss = {family: _hf_loss(str(tmp_path / f"hf_{family}"), *batches[family]) for family in FAMILIES}
    for name, (family, *_) in {**LAYOUTS, **LAYOUTS_4}.items():
        first, want = _losses(str(tmp_path / name))[0], start_loss[family]
        print(f"{name}: step 1 loss {first!r} vs transformers {want!r} (rel {abs(first - want) / want:.1e})")
        assert abs(first - want) <= RTOL * want, f"{name}: step 1 loss {first} vs transformers {want}"
    fsdp = _losses(str(tmp_path / "fsdp2"))
    assert len(fsdp) == STEPS and fsdp[-1] < fsdp[0]

    export = str(tmp_path / "fsdp2" / "hf" / f"step-{STEPS}")
    exported = {}
    for name in os.listdir(export):
        if name.endswith(".safetensors"):
            exported.update(load_file(os.path.join(export, name)))
    weights, marker = load_model_weights(str(tmp_path / "fsdp2" / "checkpoint" / f"step-{STEPS}"))
    want = hf_adapter.to_hf_state_dict(weights, marker["model"]["args"])
    assert sorted(exported) == sorted(want)
    for key, w in want.items():
        assert torch.equal(exported[key], w), key
    trained = _hf_loss(export, *batches["llama"])
    print(f"exported model's loss on the first batch {trained!r} (start {start_loss['llama']!r})")
    assert trained < start_loss["llama"]
