"""What has no Hugging Face counterpart says so in one line, before launch and in the converter; and the
checkpoint messages of issue 34: a path that does not exist, a data position of another global batch,
the exported files' mode. In process, on seed checkpoints of small models (no training)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from tests.support.hf import LLAMA3_MOE
from tests.support.scripts import script_main
from torchtitan.checkpointing.checks import check_checkpoint, check_initial_load
from torchtitan.checkpointing.common import save_model_weights
from torchtitan.checkpointing.files.marker import write_marker
from torchtitan.checkpointing.hf.convert import export_to_hf
from torchtitan.checkpointing.state import check_data_state
from torchtitan.config.errors import ConfigError
from torchtitan.config.manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.spec import get_model_spec

QWEN3_MOE_BIAS = (
    "qwen3_moe weights balanced with an expert bias (load_balance = 'bias') have no Hugging Face counterpart: "
    "Qwen3-MoE's router has no bias, and folding it into the router is not exact (the bias only picks the "
    "experts, their weights come from the unbiased scores); set model.flavor to one balanced by the aux loss, "
    "as Qwen3-MoE is: 30B-A3B, 235B-A22B or debugmodel_aux_loss"
)


def _check(*args: str):
    config = JobConfig.parse_args(["--checkpoint.enable_checkpoint", *args])
    dims = ParallelDims.from_sections(training=config.training, experimental=config.experimental, world_size=1)
    return config, dims


@pytest.mark.parametrize(
    "args, why",
    [
        (["--job.config_file", "train_configs/debug_moe.toml"], LLAMA3_MOE),
        (
            ["--job.config_file", "train_configs/qwen3_moe_debug_model.toml", "--model.flavor", "debugmodel"],
            QWEN3_MOE_BIAS,
        ),
    ],
    ids=["llama3_moe", "qwen3_moe_bias"],
)
def test_prelaunch_refuses_an_export_with_no_counterpart_in_one_line(args, why):
    with pytest.raises(NotImplementedError) as e:
        check_checkpoint(*_check(*args, "--checkpoint.last_save_in_hf"))
    assert str(e.value) == f"checkpoint.last_save_in_hf = true: {why}"


def test_prelaunch_refuses_an_import_into_a_family_with_none(tmp_path):
    config, dims = _check(
        "--job.config_file",
        "train_configs/debug_moe.toml",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path",
        str(tmp_path),
    )
    with pytest.raises(NotImplementedError) as e:
        check_initial_load(config, dims)  # before it looks for config.json there
    assert str(e.value) == f"checkpoint.initial_load_in_hf = true: {LLAMA3_MOE}"
    # the shipped configs that export pass; an import into a bias flavor is exact (its bias starts at zero)
    for name in ("debug_model", "qwen3_debug_model", "qwen3_moe_debug_model"):
        check_checkpoint(*_check("--job.config_file", f"train_configs/{name}.toml", "--checkpoint.last_save_in_hf"))
    qwen3_moe_bias = ["--job.config_file", "train_configs/qwen3_moe_debug_model.toml", "--model.flavor", "debugmodel"]
    check_checkpoint(*_check(*qwen3_moe_bias, "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "x"))


def _seed(tmp_path, name: str, flavor: str) -> str:
    """A step-0 seed checkpoint of the flavor (vocabulary 256), as a run's marker records it."""
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=256)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    path = str(tmp_path / name / "step-0")
    save_model_weights(model.state_dict(), path, {"name": name, "flavor": flavor, "args": dataclasses.asdict(args)})
    return path


@pytest.mark.parametrize(
    "name, flavor, why",
    [("llama3_moe", "debugmodel_tiny", LLAMA3_MOE), ("qwen3_moe", "debugmodel_tiny", QWEN3_MOE_BIAS)],
    ids=["llama3_moe", "qwen3_moe_bias"],
)
def test_converter_refuses_in_one_line_before_reading_a_weight(tmp_path, capsys, name, flavor, why):
    seed = _seed(tmp_path, name, flavor)
    out = str(tmp_path / "hf")
    assert script_main("convert_to_hf")([seed, out]) == 2
    assert capsys.readouterr().err == f"error: {why}\n"
    assert not os.path.exists(out)


def test_exported_files_get_the_mode_of_a_normal_save(tmp_path):
    seed = _seed(tmp_path, "llama3", "debugmodel_tiny")
    old = os.umask(0o027)
    try:
        export_to_hf(seed, str(tmp_path / "hf"))
    finally:
        os.umask(old)
    modes = {n: oct(os.stat(tmp_path / "hf" / n).st_mode & 0o777) for n in os.listdir(tmp_path / "hf")}
    assert modes == {"model.safetensors": "0o640", "config.json": "0o640"}  # safetensors alone would write 0o600


def test_a_step_folder_that_does_not_exist_is_said_so(tmp_path, capsys):
    missing = str(tmp_path / "ckpt" / "step-7")
    config, dims = _check("--checkpoint.initial_load_path", missing)
    with pytest.raises(ConfigError) as e:
        check_initial_load(config, dims)
    assert str(e.value) == (
        f"checkpoint.initial_load_path = '{missing}' does not exist; pass a complete step-N folder of a checkpoint "
        "(<dump_folder>/checkpoint/step-N)"
    )
    assert script_main("convert_to_hf")([missing, str(tmp_path / "hf")]) == 2
    assert "step-7 does not exist; pass a complete step-N folder" in capsys.readouterr().err
    # the checkpoint folder itself, not one of its steps: the newest complete one is named
    for step in (2, 4):
        os.makedirs(tmp_path / "ckpt" / f"step-{step}")
        write_marker(str(tmp_path / "ckpt" / f"step-{step}"), step, "full")
    os.makedirs(tmp_path / "ckpt" / "step-6")  # incomplete
    config, dims = _check("--checkpoint.initial_load_path", str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=r"holds checkpoints, it is not one; .* \(the newest complete: step-4\)"):
        check_initial_load(config, dims)
    config, dims = _check("--checkpoint.initial_load_path", str(tmp_path / "ckpt" / "step-6"))
    with pytest.raises(ConfigError, match=r"step-6' is not a complete checkpoint \(no .complete marker"):
        check_initial_load(config, dims)
    shutil.rmtree(tmp_path / "ckpt")


def test_a_data_position_of_another_global_batch_names_the_config_keys():
    saved = {"num_streams": 8, "seq_len": 64, "streams": {}}
    check_data_state(saved, dict(saved))
    with pytest.raises(ValueError) as e:
        check_data_state(saved, {"num_streams": 4, "seq_len": 64, "streams": {}})
    assert str(e.value) == (
        "the checkpoint's data position is for a global batch of 8 samples x training.seq_len 64, this run has "
        "4 x 64 (global batch = data-parallel degree x training.batch_size x training.gradient_accumulation_steps); "
        "resume with the same global batch and training.seq_len, or start the data from the beginning with "
        'checkpoint.exclude_from_loading = ["dataloader"]'
    )
