"""Qwen3.5 with images (``model.name = "qwen3_5_vl"``, issue 60) fine-tuned through the trainer (worker-pool jobs) on
the synthetic shapes task (scripts/build_vlm_assets.py, built here): chat rows with one or two 48x48 images each,
packed four to a 128-token window with block_causal documents, each sample's images and multimodal positions, the loss
on the assistant's word.

A 1-rank reference (the tiny flavor: 4 hybrid layers and a 2-block tower), and FSDP2 + gradient accumulation 2 (the
tower its own FSDP unit), TP2 (the language model sharded, the tower replicated) and PP2 1F1B (the tower on the first
stage, each micro-batch with its rows' images) at 2 ranks, each at loss, validation-loss and grad-norm parity (the
matrix's rule: loss rtol 1e-5, grad norm 3e-4). ``model.freeze_vision`` on FSDP2: the same first loss, a smaller first
grad norm (the tower's gradient left out) and other losses after it. LoRA on FSDP2 with images: the same first loss
(B = 0), other losses after it, and a checkpoint of the language model's adapters only (the tower frozen with the
base).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support.matrix import GRAD_NORM_RTOL, RTOL, Row, pp_schedule
from tests.support.pool import run_train_job
from tests.support.runs import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.pool(1, 2)]

ROOT = Path(__file__).resolve().parents[3]
STEPS = 4
REFERENCE = Row("vl_1proc", 1, 4)
ROWS = [
    Row("vl_fsdp2_accum2", 2, 1, ["--training.gradient_accumulation_steps", "2"]),
    # activation checkpointing (the tower's blocks too) rides on these rows (it changes no number): selective op
    # under TP, full under PP
    Row(
        "vl_tp2",
        2,
        4,
        ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
        tp=2,
    ),
    Row("vl_pp2_1f1b", 2, 4, [*pp_schedule("1F1B", microbatches=2), "--activation_checkpoint.mode", "full"], pp=2),
]
CHECKPOINT_AT_END = ["--checkpoint.enable_checkpoint", "--checkpoint.interval", str(STEPS)]
FREEZE = Row("vl_fsdp2_freeze_vision", 2, 2, ["--model.freeze_vision", *CHECKPOINT_AT_END])
LORA = Row("vl_fsdp2_lora", 2, 2, ["--lora.enable", "--lora.rank", "4", "--lora.alpha", "32", *CHECKPOINT_AT_END])
REFERENCES = [REFERENCE]
FREEZE_ROWS = [FREEZE, LORA]  # counted by the rank-row budget


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("build_vlm_assets", ROOT / "scripts" / "build_vlm_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(str(tmp_path_factory.mktemp("vlm_task")), train=48, val=16)


def _argv(row: Row, task: Path, folder: str) -> list[str]:
    return [
        *("--job.config_file", "./train_configs/qwen3_5_vl_shapes.toml", "--model.flavor", "debugmodel_tiny"),
        *(
            "--model.tokenizer_path",
            str(task / "tokenizer"),
            "--training.dataset_path",
            str(task / "shapes_train.jsonl"),
        ),
        *("--validation.dataset_path", str(task / "shapes_val.jsonl"), "--validation.freq", "2"),
        *("--training.steps", str(STEPS), "--metrics.log_freq", "1", "--training.warmup_steps", "0"),
        *("--training.batch_size", str(row.local_batch), *row.args(), "--job.dump_folder", folder),
    ]


def _run(row: Row, task: Path, folder: str) -> dict:
    status = run_train_job(row.ngpu, _argv(row, task, folder))
    assert status["ok"], status["error"]
    return _series(folder)


def _series(folder: str) -> dict[str, list[float]]:
    records = read_metrics(folder)
    out = {key: [r[key] for r in records if key in r] for key in ("loss", "grad_norm", "validation_loss")}
    assert len(out["loss"]) == STEPS and len(out["validation_loss"]) == 2, out
    return out


def _close(a: float, b: float, what: str, rtol: float) -> None:
    assert abs(a - b) <= rtol * max(abs(a), abs(b)), f"{what}: {a} vs {b} (rtol {rtol})"


@pytest.fixture(scope="module")
def reference(task, tmp_path_factory) -> dict[str, list[float]]:
    folder = str(tmp_path_factory.mktemp("vl") / REFERENCE.name)
    series = _run(REFERENCE, task, folder)
    assert series["loss"][-1] < series["loss"][0], series
    # the tower's patches are counted (MFU adds their FLOPs): 36 per 48x48 image, 4 windows of about 4 rows a step
    patches = [r["image_patches_per_step"] for r in read_metrics(folder) if "loss" in r]
    assert all(p % 36 == 0 and 12 * 36 <= p <= 24 * 36 for p in patches), patches
    return series


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_layout_at_parity(reference, task, row, tmp_path):
    got = _run(row, task, str(tmp_path / row.name))
    for key, rtol in (("loss", RTOL), ("validation_loss", RTOL), ("grad_norm", GRAD_NORM_RTOL)):
        for i, (a, b) in enumerate(zip(reference[key], got[key], strict=True)):
            _close(a, b, f"{row.name} {key} #{i}", rtol)


def _initial_tower(argv: list[str]) -> dict:
    """The tower's initial weights (a function of the seed): the run's model built and initialised in this process."""
    from torchtitan.build import build_model, build_model_args
    from torchtitan.config.manager import JobConfig
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.spec import get_model_spec

    config = JobConfig.parse_args(argv)
    spec = get_model_spec(config.model.name)
    args = build_model_args(config, spec, build_tokenizer(config.model.tokenizer_path).n_words, device_type="cpu")
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=1)
    model = build_model(config, args, dims, None, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("visual.")}


def test_freeze_vision_trains_without_the_tower(reference, task, tmp_path):
    """The same first loss, other losses after it; in the last checkpoint the tower's patch embedding, positions and
    blocks are their initial weights bit for bit, and its merger moved."""
    folder = str(tmp_path / FREEZE.name)
    got = _run(FREEZE, task, folder)
    _close(reference["loss"][0], got["loss"][0], "step 1 loss (the same weights)", RTOL)
    assert all(abs(a - b) > RTOL * abs(a) for a, b in zip(reference["loss"][1:], got["loss"][1:])), (got, reference)
    one_rank = Row(FREEZE.name, 1, 4, FREEZE.overrides)
    initial = _initial_tower(_argv(one_rank, task, folder))
    saved = {f"model.{k}": torch.empty_like(v) for k, v in initial.items()}
    dcp.load(saved, checkpoint_id=f"{folder}/checkpoint/step-{STEPS}", no_dist=True)
    moved = sorted(k for k, v in initial.items() if not torch.equal(saved[f"model.{k}"], v))
    assert moved and all(k.startswith("visual.merger.") for k in moved), moved
    assert len(moved) == sum(1 for k in initial if k.startswith("visual.merger.")), moved


def test_lora_trains_adapters_on_the_language_model_with_images(reference, task, tmp_path):
    """LoRA over image batches under FSDP2 (the tower's units all frozen): step 1 is the base's loss (B = 0), the
    adapters then move the losses, and the checkpoint holds adapters of the language model only."""
    from torchtitan.checkpointing.common import read_metadata

    folder = str(tmp_path / LORA.name)
    got = _run(LORA, task, folder)
    _close(reference["loss"][0], got["loss"][0], "step 1 loss (B = 0: the base's)", RTOL)
    assert all(abs(a - b) > RTOL * abs(a) for a, b in zip(reference["loss"][1:], got["loss"][1:])), (got, reference)
    keys = {k for k in read_metadata(f"{folder}/checkpoint/step-{STEPS}").state_dict_metadata if k.startswith("model.")}
    assert keys and all(".lora_a." in k or ".lora_b." in k for k in keys), sorted(keys)[:4]
    assert not any(k.startswith("model.visual.") for k in keys) and any(k.startswith("model.layers.") for k in keys)
