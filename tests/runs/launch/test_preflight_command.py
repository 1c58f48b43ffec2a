"""The pre-launch check as a user types it: ``python -m torchtitan.preflight [--world_size N] [--target KIND] ARGS``.

A passing check prints one ``ok:`` line naming what it checked (the config file, the world size, the device kind
and where it came from, the number of checks, what was not checked here). ``--target cuda`` checks a GPU
cluster's config from this machine (a CPU login node): upstream's 405B file at its 128 H100s passes, its device
checks run for CUDA, and the checks of this machine's files are listed as not checked here. Two processes (the
command's own output and exit code), shared by the assertions on each; the refusals call the entry function in
process, as tests/runs/launch/test_bad_input.py does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.runs import ROOT
from torchtitan.distributed.backend.device import DEVICE_TYPES, get_device_info
from torchtitan.preflight import CHECKS
from torchtitan.preflight.__main__ import main

DEBUG = "train_configs/debug_model.toml"
LLAMA_405B = "tests/assets/torchtitan_2025/llama3_405b.toml"  # NOTE: 128 H100s; float8, async TP, compile
TARGET_405B = ["--target", "cuda", "--world_size", "128", "--job.config_file", LLAMA_405B]
MACHINE_CHECKS = [c for c in CHECKS if c.reads == "machine"]


def _preflight(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchtitan.preflight", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def here_run() -> subprocess.CompletedProcess:
    return _preflight("--world_size", "2", "--job.config_file", DEBUG)


@pytest.fixture(scope="module")
def target_run() -> subprocess.CompletedProcess:
    return _preflight(*TARGET_405B)


def test_a_pass_prints_one_ok_line_naming_what_was_checked(here_run):
    here = get_device_info(0).device.type  # the device the trainer would pick on this machine
    assert (here_run.returncode, here_run.stderr) == (0, ""), here_run.stderr
    assert here_run.stdout == (
        f"ok: {DEBUG}, world_size 2, device {here} (this machine): {len(CHECKS)} checks passed\n"
    )


def test_target_checks_a_cluster_config_from_this_machine(target_run):
    """The 405B file at its 128 GPUs: 'auto' async TP resolves to the compiler's on CUDA (it is refused on a CPU
    machine without --target); upstream's tokenizer and data folders are not here, and not checked here."""
    assert target_run.returncode == 0, target_run.stderr
    assert all(line.startswith("warning: ") for line in target_run.stderr.splitlines()), target_run.stderr
    passed = len(CHECKS) - len(MACHINE_CHECKS)
    head = f"ok: {LLAMA_405B}, world_size 128, device cuda (--target): {passed} checks passed, 1 warning; "
    listed = ["torchao installed (float8)", "the tokenizer and data paths", "job.dump_folder writable"]
    assert target_run.stdout.startswith(head + "not checked here (on the cuda machines): "), target_run.stdout
    assert target_run.stdout.count("\n") == 1 and all(what in target_run.stdout for what in listed)
    # the optional features the file leaves off (LoRA, fault tolerance, evaluation) are not listed
    assert "torchft" not in target_run.stdout and "lm-eval" not in target_run.stdout


@pytest.mark.parametrize(
    "args, error",
    [
        (  # wrong for any machine: refused under --target as without it
            ["--target", "cuda", "--world_size", "4", "--training.data_parallel_shard_degree", "3"],
            "dp_replicate(1) * dp_shard(3) * cp(1) * tp(1) * pp(1) = 3 != world_size(4); "
            "set data_parallel_shard_degree = -1 to infer it",
        ),
        (  # the device checks run for the target's kind, not skipped: the 405B file on a CPU cluster
            ["--target", "cpu", *TARGET_405B[2:]],
            "experimental.async_tensor_parallel_impl = 'auto', which is 'ring' without CUDA, with training.compile "
            "= true: the ring is eager point-to-point code that full-graph compile cannot trace; turn one of them off",
        ),
        (
            ["--target", "cpu", "--profiling.enable_memory_snapshot"],
            "profiling.enable_memory_snapshot = true: memory snapshots are CUDA's allocator history and the run "
            "trains on 'cpu'; set it to false (profiling.enable_profiling traces CPU memory)",
        ),
        (
            ["--target", "gpu"],
            f"--target needs the device kind of the machines the run will train on, one of {list(DEVICE_TYPES)}, "
            "got 'gpu'",
        ),
    ],
    ids=["layout", "async-tp-on-cpu", "memory-snapshot-on-cpu", "unknown-kind"],
)
def test_target_refuses_in_one_line(args, error, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(args) == 2
    assert capsys.readouterr() == ("", f"error: {error}\n")


def test_target_cuda_runs_the_device_checks_for_cuda(capsys, monkeypatch):
    """What CUDA allows passes from this machine, whatever it has: the memory snapshot, FlexAttention."""
    monkeypatch.chdir(ROOT)
    flex = ["--model.attn_mask_type", "block_causal", "--model.attention_backend", "flex"]
    assert main(["--target", "cuda", "--profiling.enable_memory_snapshot", *flex]) == 0
    assert capsys.readouterr().out.startswith("ok: the default config, world_size 1, device cuda (--target): ")


def test_help_names_the_flags_and_every_machine_check_has_its_name(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "[--world_size N] [--target {cpu,cuda}] ARGS" in text and '"not checked here"' in text
    assert MACHINE_CHECKS and all(c.what for c in MACHINE_CHECKS)
