"""scripts/convert_to_hf.py, convert_from_hf.py and dcp_to_torch.py on a real (1-process) checkpoint.

The scripts' ``main`` runs in this process (no interpreter start); the tensors they write are
compared with the saved model exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from tests.support.checkpoint import ARGS, tiny_llama, tiny_manager, tiny_train_step
from tests.support.scripts import script_main
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.files.marker import step_folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def saved(tmp_path):
    """(step-2 folder of a full checkpoint, the model's state dict at the save)."""
    model = tiny_llama(0)
    manager = tiny_manager(tmp_path, model)
    tiny_train_step(model, manager)
    manager.save(2)
    manager.close()
    return step_folder(str(tmp_path / "ckpt"), 2), {k: v.clone() for k, v in model.state_dict().items()}


def test_hf_scripts_round_trip(saved, tmp_path, capsys):
    folder, state = saved
    hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "seed" / "step-0")
    assert script_main("convert_to_hf")([folder, hf_dir, "--dtype", "bfloat16"]) == 0
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    assert config["torch_dtype"] == "bfloat16" and config["num_hidden_layers"] == ARGS.n_layers
    assert config["num_key_value_heads"] == ARGS.n_kv_heads and config["architectures"] == ["LlamaForCausalLM"]
    assert script_main("convert_from_hf")([hf_dir, back]) == 0
    weights, marker = load_model_weights(back)
    assert marker["kind"] == "seed" and set(weights) == set(state)
    for name, want in state.items():
        assert torch.equal(weights[name], want.to(torch.bfloat16)), name


def test_dcp_to_torch_full_and_model_only(saved, tmp_path):
    folder, state = saved
    full, model_only = str(tmp_path / "full.pt"), str(tmp_path / "model.pt")
    assert script_main("dcp_to_torch")([folder, full]) == 0
    assert script_main("dcp_to_torch")([folder, model_only, "--model-only"]) == 0
    weights = torch.load(model_only, weights_only=True)
    assert set(weights) == set(state) and all(torch.equal(weights[k], v) for k, v in state.items())
    everything = torch.load(full, weights_only=True)
    assert {"model", "optimizer"} <= set(everything)


def test_scripts_refuse_missing_and_incomplete_folders(saved, tmp_path, capsys):
    folder, _ = saved
    incomplete = str(tmp_path / "step-9")
    shutil.copytree(folder, incomplete)
    os.remove(os.path.join(incomplete, ".complete"))
    for args in ([str(tmp_path / "nope"), str(tmp_path / "x.pt")], [incomplete, str(tmp_path / "x.pt")]):
        assert script_main("dcp_to_torch")(args) == 2
    assert script_main("convert_to_hf")([incomplete, str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "step-9 is incomplete" in err and "step-9 is not a complete checkpoint" in err


def test_hf_export_loads_in_transformers_with_our_logits(saved, tmp_path):
    """The real consumer: transformers' LlamaForCausalLM on the converted folder gives our logits."""
    import transformers

    from tests.support.checkpoint import tiny_llama

    folder, state = saved
    hf_dir = str(tmp_path / "hf")
    assert script_main("convert_to_hf")([folder, hf_dir]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = tiny_llama(1)
    ours.load_state_dict(state)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_a_checkpoint_a_later_run_moved_is_found_and_the_recorded_tokenizer_used(saved, tmp_path, capsys):
    """generate.py on a step folder that a later run in the dump folder set aside names where it is now; on a
    checkpoint whose marker records the run's tokenizer it reads with that one, and says so when it is gone."""
    from torchtitan.checkpointing.files.marker import read_marker, write_marker
    from torchtitan.launch.run_folder import set_aside_earlier_run

    folder, _ = saved
    generate = importlib.util.module_from_spec(
        spec := importlib.util.spec_from_file_location("generate_script", os.path.join(ROOT, "scripts", "generate.py"))
    )
    spec.loader.exec_module(generate)
    moved_to = set_aside_earlier_run(str(tmp_path), ["ckpt"])  # what a later run in the folder does
    assert generate.main([folder, "--prompt", "def main("]) == 2
    err = capsys.readouterr().err.splitlines()
    now = os.path.join(moved_to, "ckpt", "step-2")
    assert err == [
        f"error: {folder} does not exist (a later run in its dump folder moved it to {now}); pass that folder"
    ]
    marker = {k: v for k, v in read_marker(now).items() if k not in ("step", "kind", "time")}
    tokenizer = os.path.join(ROOT, "tests", "assets", "sft", "tokenizer")
    write_marker(now, 2, "full", **{**marker, "data": {"tokenizer": tokenizer}})
    assert generate.default_tokenizer(None, now) == tokenizer
    write_marker(now, 2, "full", **{**marker, "data": {"tokenizer": str(tmp_path / "gone")}})
    assert generate.main([now, "--prompt", "def main("]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: checkpoint {now} was trained with the tokenizer {tmp_path / 'gone'}, which does not exist here; "
        "pass --tokenizer, the same tokenizer's file or folder"
    ]
