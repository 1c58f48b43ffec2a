"""LoRA in the tests: tiny models with adapters built in process, their base as a transformers model, the runs' parity."""

from __future__ import annotations

import torch
from torch import nn

from tests.support.matrix import GRAD_NORM_RTOL, RTOL, MatrixLaunches, Row, check_grad_norms, check_row
from torchtitan.build import build_model, build_model_args
from torchtitan.checkpointing.hf.convert import save_hf_folder
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.features.lora.linear import is_adapter_key
from torchtitan.spec import get_model_spec

TINY = ["--job.config_file", "./train_configs/debug_model.toml", "--model.flavor", "debugmodel_tiny"]


def tiny_config(*extra: str, world_size: int = 1) -> JobConfig:
    return JobConfig.parse_args([*TINY, "--training.seed", "7", *extra], world_size=world_size)


def tiny_model(*extra: str) -> nn.Module:
    cfg = tiny_config(*extra)
    spec = get_model_spec(cfg.model.name)
    args = build_model_args(cfg, spec, 512, device_type="cpu")
    dims = ParallelDims.from_sections(training=cfg.training, experimental=cfg.experimental, world_size=1)
    return build_model(cfg, args, dims, None, torch.device("cpu"))


PEFT_TOL = 1e-5


def save_hf_base(model: nn.Module, family: str, args: dict, folder: str) -> nn.Module:
    spec = get_model_spec(family)
    base = {k: v.detach() for k, v in model.state_dict().items() if not is_adapter_key(k)}
    hf = spec.state_dict_adapter.to_hf_state_dict(base, args)
    save_hf_folder(hf, spec.state_dict_adapter.hf_config(args, base, dtype=torch.float32), folder)
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def check_lora_parity(row: Row, reference: Row, matrix: MatrixLaunches) -> dict[str, list[float]]:
    """The row's losses within RTOL of the one-process LoRA run's, its grad norms within GRAD_NORM_RTOL; the
    reference's records (also the MoE LoRA rows' check: tests/runs/features/test_lora_moe_runs.py)."""
    check_row(row)
    got, want = matrix.losses(row), matrix.losses(reference)
    gaps = [abs(g - w) / abs(w) for g, w in zip(got["loss"], want["loss"], strict=True)]
    print(row.name, "gap to one process", [f"{g:.2e}" for g in gaps])
    assert max(gaps) <= RTOL, f"{row.name}: {got['loss']} vs single-process {want['loss']}"
    check_grad_norms(row.name, got["grad_norm"], want["grad_norm"], GRAD_NORM_RTOL)
    return want
