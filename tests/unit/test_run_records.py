"""A run's dump folder (issue 34): one run per folder, a command.txt whose reproduce line reproduces, the
start and end summaries, and the README's commands that say so. In process; the runs themselves (a second
run set aside, a resume appending, the pasted reproduce line) are tests/runs/launch/test_run_folder_runs.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

import pytest

from torchtitan.checkpointing.files.folders import resume_point
from torchtitan.checkpointing.files.marker import EXPORT, FULL, SEED, write_marker
from torchtitan.config.manager import JobConfig
from torchtitan.config.schema import Training
from torchtitan.engine.summary import describe_start
from torchtitan.launch.run_folder import EARLIER_RUNS, set_aside_earlier_run
from torchtitan.observability.console import format_data_source, format_end_summary, format_start_summary
from torchtitan.observability.run_records import RUN_SCRIPT, run_record_names, write_run_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write(path, text: str = "x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _config(folder, *extra: str) -> JobConfig:
    return JobConfig.parse_args(
        ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(folder), *extra]
    )


def test_earlier_run_is_moved_aside_whole_and_only_its_records(tmp_path):
    folder = str(tmp_path / "run")
    names = run_record_names(_config(folder))
    _write(f"{folder}/metrics.jsonl", '{"step": 1, "loss": 8.0}\n')
    _write(f"{folder}/run_info.json", json.dumps({"started": "2025-01-02T03:04:05+0000"}))
    for name in ("config.toml", "command.txt", "tb/events", "checkpoint/step-2/.metadata", "hf/step-2/config.json"):
        _write(f"{folder}/{name}")
    _write(f"{folder}/rank0.log")  # not a run record (the tests' pool writes it): stays
    _write(f"{folder}/notes.txt")  # the user's: stays
    dest = set_aside_earlier_run(folder, names)
    assert dest == os.path.join(folder, EARLIER_RUNS, "run-2025-01-02T03-04-05")
    assert sorted(os.listdir(dest)) == sorted(
        ["metrics.jsonl", "run_info.json", "config.toml", "command.txt", "tb", "checkpoint", "hf"]
    )
    assert sorted(os.listdir(folder)) == [EARLIER_RUNS, "notes.txt", "rank0.log"]
    # a later run that started at the same second gets a folder of its own
    _write(f"{folder}/metrics.jsonl", '{"step": 1}\n')
    _write(f"{folder}/run_info.json", json.dumps({"started": "2025-01-02T03:04:05+0000"}))
    assert set_aside_earlier_run(folder, names) == dest + "-2"


def test_a_start_that_logged_nothing_is_replaced_and_foreign_paths_are_never_moved(tmp_path):
    folder = str(tmp_path / "run")
    for name in ("config.toml", "command.txt", "run_info.json", "metrics.jsonl"):
        _write(f"{folder}/{name}", "" if name == "metrics.jsonl" else "x")
    os.makedirs(f"{folder}/tb")
    assert set_aside_earlier_run(folder, run_record_names(_config(folder))) is None  # nothing worth keeping
    assert not os.path.exists(os.path.join(folder, EARLIER_RUNS))
    _write(f"{folder}/keep/file")
    _write(str(tmp_path / "outside" / "file"))
    unsafe = ["", ".", "..", "keep/file", str(tmp_path / "outside"), "../outside", EARLIER_RUNS, "run.lock"]
    assert set_aside_earlier_run(folder, unsafe) is None
    assert os.path.isfile(f"{folder}/keep/file") and os.path.isfile(str(tmp_path / "outside" / "file"))
    # a link is the user's (a checkpoint folder on another disk): it stays, and keeps nothing of a run
    os.remove(f"{folder}/metrics.jsonl")
    os.symlink(str(tmp_path / "outside"), f"{folder}/checkpoint")
    os.symlink(str(tmp_path / "outside" / "file"), f"{folder}/metrics.jsonl")
    assert set_aside_earlier_run(folder, run_record_names(_config(folder))) is None
    assert os.path.islink(f"{folder}/checkpoint") and os.path.islink(f"{folder}/metrics.jsonl")


def test_resume_point_is_what_the_load_would_pick(tmp_path):
    root = str(tmp_path / "checkpoint")
    assert resume_point(root, enabled=True, load_step=-1) is None
    for step, kind in ((0, SEED), (2, FULL), (4, EXPORT)):
        os.makedirs(f"{root}/step-{step}")
        write_marker(f"{root}/step-{step}", step, kind)
    os.makedirs(f"{root}/step-6")  # incomplete
    assert resume_point(root, enabled=True, load_step=-1).step == 2
    assert resume_point(root, enabled=False, load_step=-1) is None
    assert resume_point(root, enabled=True, load_step=4).step == 4  # the load then says what is wrong with it
    assert resume_point(root, enabled=True, load_step=9) is not None  # a resume that fails, naming the steps there


def test_command_txt_reproduce_line_and_resume_appends(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    write_run_records(_config(folder), 2)
    lines = (folder / "command.txt").read_text().splitlines()
    assert lines[0].startswith("# started by ") and lines[1] == "# reproduce (2 processes; into run-reproduced/):"
    env = f"NGPU=2 PYTHON={shlex.quote(sys.executable)} CONFIG_FILE={folder}/config.toml"
    assert lines[2] == f"cd {shlex.quote(os.getcwd())} && {env} {RUN_SCRIPT} --job.dump_folder {folder}-reproduced"
    assert json.loads((folder / "run_info.json").read_text())["resumed_from_step"] is None
    write_run_records(_config(folder), 2, resumed_from=10)
    again = (folder / "command.txt").read_text().splitlines()
    assert again[:3] == lines and again[3].startswith("# resumed from checkpoint step-10 at ") and again[-1] == lines[2]
    assert json.loads((folder / "run_info.json").read_text())["resumed_from_step"] == 10


def test_reproduce_line_on_several_nodes_names_the_launcher(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    write_run_records(_config(folder, "--training.data_parallel_shard_degree", "16"), 16)
    comment, command = (folder / "command.txt").read_text().splitlines()[1:]
    assert (
        comment == "# reproduce (16 processes: 8 on each of 2 nodes, HOST:PORT your rendezvous; into run-reproduced/):"
    )
    assert f"{shlex.quote(sys.executable)} -m torchtitan.launch --nnodes=2 --nproc_per_node=8 " in command
    assert command.endswith(
        f"-m torchtitan.train --job.config_file {folder}/config.toml --job.dump_folder {folder}-reproduced"
    )


def test_the_documented_reproduce_line_is_command_txts():
    """README points to docs/reading_a_run.md for command.txt; the line shown there is the one command.txt ends with
    (the same number of processes: one process would train half the global batch)."""
    doc = open(os.path.join(ROOT, "docs", "reading_a_run.md")).read()
    assert "python -m torchtitan.train --job.config_file <dump>/config.toml" not in doc
    assert (
        "cd <dir> && NGPU=<world size> PYTHON=<python> CONFIG_FILE=<dump>/config.toml ./run_llama_train.sh "
        "--job.dump_folder <dump>-reproduced" in doc
    )
    assert "command.txt" in open(os.path.join(ROOT, "README.md")).read()


def test_readme_check_only_examples_pass_on_a_fresh_checkout(capsys):
    """Every ``python -m torchtitan.preflight`` line of the README exits 0 here (no tokenizer downloaded)."""
    from torchtitan.preflight.__main__ import main

    readme = open(os.path.join(ROOT, "README.md")).read()
    commands = re.findall(r"^python -m torchtitan\.preflight (.+?)(?:\s+#.*)?$", readme, re.MULTILINE)
    assert commands
    for command in commands:
        assert main(shlex.split(command)) == 0, (command, capsys.readouterr().err)


def test_start_summary_names_the_count_per_token_and_end_summary_this_runs_steps():
    training = Training(seq_len=256, steps=30, dataset="sft_arith", dataset_format="chat")
    summary = format_start_summary(
        model="qwen3_moe debugmodel",
        params=21_000_000,
        flop_params=7_424_256,
        layout="single process",
        world_size=1,
        global_batch=8,
        training=training,
        data=format_data_source(training, indexed=False),
        start="fresh",
        trains=["LoRA rank 8 on wq: 1.00% of parameters trainable"],
        device="cpu",
        dump_folder="out",
    )
    assert "data        chat: sft_arith" in summary
    assert "trains      LoRA rank 8 on wq: 1.00% of parameters trainable" in summary
    assert "21,000,000 parameters, 7,424,256 of them multiply each token (MFU's N)" in summary
    assert "without the embedding" not in summary  # MoE: that number is the active count, not a total minus the table
    common = dict(wall_s=5, mean_tps=1000.0, best_loss=6.5, best_step=30, last_validation=None, checkpoint="c")
    assert format_end_summary(steps=30, **common).startswith("done: 30 steps in 0:00:05")
    resumed = format_end_summary(steps=30, start_step=10, **common)
    assert resumed.startswith("done: 30 steps (20 this run, resumed after step 10) in 0:00:05")


def test_start_summary_names_the_data_by_kind_and_where_the_weights_come_from(tmp_path):
    """Issue 56, item 5: an indexed corpus is 'indexed', not the dataset name's 'text'; initial weights are not a
    resume. (The runs: tests/runs/features/test_indexed_runs.py, tests/runs/features/test_lora_runs.py, tests/runs/launch/test_launch_runs.py.)"""
    prefix = str(tmp_path / "corpus")
    assert format_data_source(Training(dataset_path=prefix), indexed=True) == f"indexed: {prefix}"
    assert format_data_source(Training(dataset="pydocs"), indexed=False) == "text: pydocs"
    assert format_data_source(Training(dataset_mix=["a:0.7", "b:0.3"]), indexed=False) == "blend of 2: a:0.7, b:0.3"
    folder = tmp_path / "run"
    fresh = _config(folder, "--checkpoint.enable_checkpoint", "--training.seed", "3")
    assert describe_start(fresh, partial=False) == "fresh: weights initialized from training.seed 3"
    hf = _config(folder, "--checkpoint.initial_load_path", "hf_in", "--checkpoint.initial_load_in_hf")
    assert describe_start(hf, partial=False) == "initial weights from hf_in (Hugging Face)"
    root = f"{folder}/checkpoint"
    for step in (0, 4):
        os.makedirs(f"{root}/step-{step}")
    write_marker(f"{root}/step-0", 0, SEED)
    assert describe_start(fresh, partial=False) == f"seed checkpoint {root}/step-0 (model weights only)"
    write_marker(f"{root}/step-4", 4, FULL)
    assert describe_start(fresh, partial=False) == f"resumed from step 4 ({root}/step-4)"
    adapters = _config(folder, "--checkpoint.enable_checkpoint", "--checkpoint.initial_load_path", "base")
    assert (
        describe_start(adapters, partial=True)
        == f"resumed from step 4 ({root}/step-4); base: initial weights from base"
    )


@pytest.mark.parametrize("name", ["config.toml", "command.txt", "run_info.json", "metrics.jsonl"])
def test_every_record_the_summary_lists_is_a_run_record(name):
    assert name in run_record_names(_config("out"))
