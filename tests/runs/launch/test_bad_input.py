"""Bad input: one clear line on stderr and a non-zero exit, never a hang or a torch traceback.

Config-level mistakes are caught by run_llama_train.sh's one-process check before torchrun starts
("error: ..."), bad NGPU / LOG_RANK by the script itself. The last tests go through torchrun to the
trainer (PREFLIGHT=0 where the check would catch it first): what only a rank sees is printed once
by the launcher, with the ranks that raised it ("error (ranks 0,1): ..."), whatever LOG_RANK shows.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.support.runs import ROOT, error_lines

SMALL = ["--training.steps", "2", "--training.seq_len", "64", "--training.batch_size", "2"]


def launch(
    args: list[str],
    ngpu: int | str = 2,
    config: str = "./train_configs/debug_model.toml",
    timeout: int = 120,
    **env: str,
):
    env = dict(os.environ, NGPU=str(ngpu), CONFIG_FILE=config, **env)
    return subprocess.run(
        ["bash", "./run_llama_train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _one_error_line(result: subprocess.CompletedProcess, expected: str, code: int = 2) -> str:
    out = result.stdout + result.stderr
    lines = error_lines(out)
    assert result.returncode == code and len(lines) == 1 and expected in lines[0], out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "args, config, expected",
    [
        ([], "./missing.toml", "error: config file not found: './missing.toml'"),
        ([], "BAD_TOML", "bad.toml: line 1, column 10: not valid TOML"),
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
            ["--float8.enable_float8_linear", "--float8.recipe_name", "mxfp8"],
            None,
            "float8.recipe_name = 'mxfp8': torchao 0.18's MX training",
        ),
        (
            ["--optimizer.early_step_in_backward"],
            None,
            "optimizer.early_step_in_backward = true with training.max_norm = 1.0: clipping needs the total",
        ),
        (
            ["--optimizer.early_step_in_backward", "--training.max_norm", "0"]
            + ["--training.gradient_accumulation_steps", "2"],
            None,
            "optimizer.early_step_in_backward = true with training.gradient_accumulation_steps = 2",
        ),
        (["--training.dataset", "c5"], None, "config key 'training.dataset': got 'c5' (str), expected 'pydocs' |"),
        (
            ["--profiling.enable_profiling", "--profiling.profile_freq", "1"],
            None,
            "profiling.profile_freq = 1 with profiling.enable_profiling = true: each window holds profiler_warmup",
        ),
        (["--job.dump_folder", "A_FILE/out"], None, "is a file, not a folder; choose another path"),
        (
            ["--experimental.context_parallel_degree", "2", "--training.seq_len", "90"],
            None,
            "training.seq_len = 90 is not divisible by 2 x context_parallel_degree (load balancing) = 4",
        ),
        (
            ["--checkpoint.initial_load_path", "./no_such_hf", "--checkpoint.initial_load_in_hf"],
            None,
            "Hugging Face folder './no_such_hf' does not exist",
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
        "float8-mxfp8",
        "in-backward-max-norm",
        "in-backward-grad-accum",
        "unknown-dataset",
        "profile-freq",
        "dump-folder-under-a-file",
        "cp-seq-len",
        "initial-load-in-hf",
    ],
)
def test_prelaunch_check_rejects_bad_input_in_one_line(args, config, expected, tmp_path, capsys, monkeypatch):
    """The check run_llama_train.sh's launcher runs before torchrun (``python -m torchtitan.preflight``'s, in
    ``python -m torchtitan.preflight_launch``), called in process: the same one line and exit code 2; the script's own
    plumbing of it is the subprocess case below."""
    from torchtitan.preflight.__main__ import main

    if config == "BAD_TOML":
        bad = tmp_path / "bad.toml"
        bad.write_text("[training\nsteps = 1\n")
        config = str(bad)
    (tmp_path / "a_file").write_text("not a folder")
    args = [a.replace("A_FILE", str(tmp_path / "a_file")) for a in args]
    monkeypatch.chdir(ROOT)
    code = main(["--world_size", "2", "--job.config_file", config or "./train_configs/debug_model.toml", *args])
    out = capsys.readouterr()
    assert code == 2, out.err
    lines = error_lines(out.err + out.out)
    assert len(lines) == 1 and expected in lines[0], out.err
    assert "Traceback" not in out.err + out.out


def test_launcher_stops_on_the_prelaunch_check_in_one_line():
    """Through run_llama_train.sh: the check's one line and exit code reach the user, and torchrun never starts."""
    result = launch(["--training.tensor_paralel_degree", "2"])
    line = _one_error_line(result, "did you mean 'training.tensor_parallel_degree'?")
    assert line.startswith("error: unknown config key")
    assert "torchrun" not in result.stdout + result.stderr and "rank" not in line


@pytest.mark.parametrize(
    "argv, expected",
    [
        # the world size is nproc_per_node x nnodes: dp_shard 2 does not fit 2 x 2
        (
            [
                "--nnodes",
                "2",
                "--nproc_per_node",
                "2",
                "-m",
                "torchtitan.train",
                "--training.data_parallel_shard_degree",
                "2",
            ],
            "= 2 != world_size(4)",
        ),
        (["--nproc_per_node", "auto", "-m", "torchtitan.train"], "the pre-launch check needs the run's world size"),
        (["--nnodes", "1:2", "--nproc_per_node", "2", "-m", "torchtitan.train"], "got '1:2'"),
        (
            ["--nproc_per_node", "2", "train.py"],
            "checks the trainer's config: launch -m torchtitan.train (got train.py)",
        ),
    ],
    ids=["world-size", "nproc-auto", "elastic-nnodes", "not-the-trainer"],
)
def test_launcher_preflight_checks_for_its_world_size_before_any_rank(argv, expected, capsys, monkeypatch):
    """``python -m torchtitan.preflight_launch`` (what run_llama_train.sh runs): the check's one line and exit code 2,
    before torchrun would start anything (its run is replaced by a failing stand-in)."""
    from torchtitan import preflight_launch
    from torchtitan.launch import launcher

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(launcher, "run", lambda args: pytest.fail("torchrun started"))
    assert preflight_launch.main(argv) == 2
    out = capsys.readouterr()
    lines = error_lines(out.err + out.out)
    assert len(lines) == 1 and expected in lines[0], out.err


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"NGPU": "0"}, "error: NGPU = '0': the number of processes to start must be a positive integer"),
        ({"NGPU": "abc"}, "error: NGPU = 'abc': the number of processes to start must be a positive integer"),
        ({"NGPU": "2", "LOG_RANK": "2"}, "error: LOG_RANK = '2': rank 2 does not exist with NGPU = 2"),
    ],
    ids=["ngpu-0", "ngpu-abc", "log-rank"],
)
def test_launcher_rejects_bad_ngpu_and_log_rank(env, expected):
    result = launch([], ngpu=env.pop("NGPU"), **env)
    assert _one_error_line(result, expected).startswith(expected)


def test_trainer_error_after_launch_is_one_line_with_its_ranks(tmp_path):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text('{"text": "far too small"}\n')
    result = launch(["--training.dataset_path", str(tiny), "--job.dump_folder", str(tmp_path / "out")])
    line = _one_error_line(result, "fewer than one sample of seq_len + 1 = 257")
    # every rank raises it; the launcher prints it once (a rank stopped by torchrun first leaves no record)
    assert line.startswith(("error (ranks 0,1): dataset", "error (rank 0): dataset", "error (rank 1): dataset"))


def test_a_bad_row_shows_its_error_ranks_and_file(tmp_path):
    """A null text in the data: found when the data is loaded, named by file and line, on the user's screen
    although LOG_RANK shows rank 0 only and rank 1 may be the one that reports it."""
    data = tmp_path / "corpus.jsonl"
    rows = [json.dumps({"text": f"document {i}: " + "words of text " * 30}) for i in range(40)]
    rows[23] = json.dumps({"text": None})
    data.write_text("\n".join(rows) + "\n")
    result = launch([*SMALL, "--training.dataset_path", str(data), "--job.dump_folder", str(tmp_path / "out")])
    line = _one_error_line(result, f"data file '{data}', line 24: 'text' is null")
    assert re.match(r"error \(ranks? (0,1|0|1)\): data file", line), line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to fill a disk")
def test_a_full_disk_after_launch_is_one_line(tmp_path):
    """metrics.jsonl on a full disk (a link to /dev/full: every write fails with ENOSPC) at the first step.
    A read-only folder or a path through a file fails the same way (storage_error, tests/unit/test_launch.py);
    before launch, the pre-launch check finds those without writing (the dump-folder case above)."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "metrics.jsonl").symlink_to("/dev/full")
    result = launch([*SMALL, "--metrics.log_freq", "1", "--job.dump_folder", str(folder)], ngpu=1, PREFLIGHT="0")
    _one_error_line(result, "error (rank 0): No space left on device; free some space or choose another folder")
