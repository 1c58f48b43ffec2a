"""Every shipped debug config trains, checkpoints and exports to Hugging Face, or says in one line why not
(issue 34).

Each config trains 3 steps on one rank (a pool job, steps and sequences shortened), saves its last
step, and ``scripts/convert_to_hf.py``'s ``main`` converts it; transformers loads the folder with no
missing or unexpected weight and its logits equal ours on the same checkpoint (fp32, max |Δ| <= EXPORT_TOL).
``debug_moe.toml`` (llama3_moe, which has no HF counterpart) is refused with its one line, exactly.
"""

from __future__ import annotations

import os

import pytest

from tests.support.hf import LLAMA3_MOE, SHORT, check_export_logits
from tests.support.pool import run_train_job
from tests.support.scripts import script_main

pytestmark = [pytest.mark.integration, pytest.mark.pool(1)]

transformers = pytest.importorskip("transformers")

# config -> the converter's refusal (None: it exports)
SHIPPED = {
    "debug_model": None,
    "qwen3_debug_model": None,
    "qwen3_moe_debug_model": None,
    "debug_moe": LLAMA3_MOE,
    "sft_debug": None,
    "deepseek_v3_debug": None,
    "deepseek_v32_debug": None,
    "gpt_oss_debug": None,
    "deepseek_v4_debug": None,
}

# configs whose sparse attention needs more than SHORT's tokens to choose among (the pre-launch check refuses an
# index_topk the sequence cannot make sparse): V3.2's debugmodel keeps 64 keys, V4's keeps 8 of seq_len // 4 entries
LONGER = {"deepseek_v32_debug": ["--training.seq_len", "72"], "deepseek_v4_debug": ["--training.seq_len", "40"]}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_trains_and_exports_with_our_logits(name, tmp_path, capsys):
    folder = tmp_path / "run"
    argv = ["--job.config_file", f"./train_configs/{name}.toml", *SHORT, *LONGER.get(name, [])]
    argv += ["--job.dump_folder", str(folder)]
    status = run_train_job(1, argv)
    assert status["ok"], status["error"]
    step, out = str(folder / "checkpoint" / "step-3"), str(tmp_path / "hf")
    code = script_main("convert_to_hf")([step, out])
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
