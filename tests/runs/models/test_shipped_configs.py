"""Every shipped debug config trains, checkpoints and exports to Hugging Face, or says in one line why not
(issue 34).

Each config trains 3 steps on one rank (a pool job, steps and sequences shortened), saves its last
step, and ``scripts/convert_to_hf.py``'s ``main`` converts it; transformers loads the folder with no
missing or unexpected weight and its logits equal ours on the same checkpoint (fp32, max |Δ| <= TOL).
``debug_moe.toml`` (llama3_moe, which has no HF counterpart) is refused with its one line, exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.pool import run_train_job
from tests.unit.test_checkpoint_scripts import _script
from tests.unit.test_hf_refusals import LLAMA3_MOE
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.spec import get_model_spec

pytestmark = [pytest.mark.integration, pytest.mark.pool(1)]

transformers = pytest.importorskip("transformers")

TOL = 1e-5  # fp32; measured max |Δlogits| 1.2e-6 to 1.4e-6 (the export is exact; the two forwards sum in other orders)
SEQ = 32
SHORT = [
    *("--training.steps", "3", "--training.seq_len", str(SEQ), "--training.batch_size", "2"),
    *("--training.warmup_steps", "1", "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32"),
    *("--checkpoint.enable_checkpoint", "--checkpoint.interval", "1000", "--validation.enabled", "false"),
]
# config -> the converter's refusal (None: it exports)
SHIPPED = {
    "debug_model": None,
    "qwen3_debug_model": None,
    "qwen3_moe_debug_model": None,
    "debug_moe": LLAMA3_MOE,
    "sft_debug": None,
    "deepseek_v3_debug": None,
    "gpt_oss_debug": None,
}


def _ours(step_folder: str) -> tuple[torch.nn.Module, int]:
    """Our model with the checkpoint's weights (fp32, eval), and its vocabulary."""
    weights, marker = load_model_weights(step_folder)
    spec = get_model_spec(marker["model"]["name"])
    args = type(next(iter(spec.flavors.values()))).from_dict(marker["model"]["args"])
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    model.load_state_dict(weights)
    return model.eval(), args.vocab_size


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_trains_and_exports_with_our_logits(name, tmp_path, capsys):
    folder = tmp_path / "run"
    argv = ["--job.config_file", f"./train_configs/{name}.toml", *SHORT, "--job.dump_folder", str(folder)]
    status = run_train_job(1, argv)
    assert status["ok"], status["error"]
    step, out = str(folder / "checkpoint" / "step-3"), str(tmp_path / "hf")
    code = _script("convert_to_hf")([step, out])
    err = capsys.readouterr().err
    if SHIPPED[name] is not None:
        assert (code, err) == (2, f"error: {SHIPPED[name]}\n")
        return
    assert code == 0, err
    umask = os.umask(0)
    os.umask(umask)
    assert {n: os.stat(os.path.join(out, n)).st_mode & 0o777 for n in os.listdir(out)} == {
        "model.safetensors": 0o666 & ~umask,
        "config.json": 0o666 & ~umask,
    }
    check_export_logits(name, step, out)


def check_export_logits(name: str, step: str, out: str) -> None:
    """transformers loads the HF folder ``out`` with no missing or unexpected weight, and its logits equal those
    of our model with the checkpoint ``step``'s weights (fp32, max |Δ| <= TOL)."""
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours, vocab = _ours(step)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        delta = (hf.eval()(tokens).logits - ours(tokens)).abs().max().item()
    print(f"\n{name}: {type(hf).__name__}, max |dlogits| {delta:.1e}")
    assert delta <= TOL, f"{name}: max |dlogits| {delta} > {TOL}"
