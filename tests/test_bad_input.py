"""Bad input: one clear line on stderr and a non-zero exit, never a hang or a torch traceback.

Config-level mistakes are caught by run_llama_train.sh's one-process check before torchrun starts;
the last test goes through torchrun to the trainer itself (a data problem only the trainer sees).
"""

from __future__ import annotations

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(args: list[str], ngpu: int = 2, config: str = "./train_configs/debug_model.toml", timeout: int = 120):
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=config)
    return subprocess.run(
        ["bash", "./run_llama_train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


@pytest.mark.parametrize(
    "args, config, expected",
    [
        ([], "./missing.toml", "error: config file not found: './missing.toml'"),
        ([], "BAD_TOML", "is not valid TOML"),
        (["--training.tensor_paralel_degree", "2"], None, "did you mean 'training.tensor_parallel_degree'?"),
        (
            ["--training.data_parallel_shard_degree", "3"],
            None,
            "dp_replicate(1) * dp_shard(3) * cp(1) * tp(1) * pp(1) = 3 != world_size(2)",
        ),
        (
            ["--training.seq_len", "4096"],
            None,
            "training.seq_len = 4096 does not fit model debugmodel, whose max_seq_len is 2048",
        ),
        (
            ["--model.tokenizer_path", "./nope.tiktoken"],
            None,
            "model.tokenizer_path = './nope.tiktoken' does not exist",
        ),
        (
            ["--training.dataset_path", "./no/such/data.jsonl"],
            None,
            "training.dataset_path = './no/such/data.jsonl' does not exist",
        ),
        (["--experimental.enable_compiled_autograd"], None, "compiled autograd is not available yet"),
        (
            ["--experimental.context_parallel_degree", "2", "--training.seq_len", "90"],
            None,
            "training.seq_len = 90 is not divisible by 2 x context_parallel_degree (load balancing) = 4",
        ),
    ],
    ids=[
        "missing-config",
        "bad-toml",
        "unknown-key",
        "degrees",
        "seq-len",
        "tokenizer",
        "dataset-path",
        "not-built",
        "cp-seq-len",
    ],
)
def test_launcher_rejects_bad_input_in_one_line(args, config, expected, tmp_path):
    if config == "BAD_TOML":
        bad = tmp_path / "bad.toml"
        bad.write_text("[training\nsteps = 1\n")
        config = str(bad)
    result = launch(args, config=config or "./train_configs/debug_model.toml")
    assert result.returncode != 0
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_trainer_error_after_launch_is_one_line_on_rank0(tmp_path):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "far too small"}\n')
    result = launch(["--training.dataset_path", str(tiny), "--job.dump_folder", str(tmp_path / "out")])
    assert result.returncode != 0
    out = result.stdout + result.stderr
    lines = [line for line in out.splitlines() if "error: dataset" in line]
    assert len(lines) == 1, out  # rank 0 only
    assert lines[0].startswith("[rank0]:") and "fewer than one sample of seq_len + 1 = 257" in lines[0]
