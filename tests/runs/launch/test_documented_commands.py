"""Every launch command our docs show passes the pre-launch check of the config it would train.

The commands are read from README.md, docs/*.md, the train_configs headers and scripts/ (lines that run
``run_llama_train.sh`` or ``python -m torchtitan.preflight``); each is resolved the way run_llama_train.sh
resolves it (scripts/config_args.sh: the command's ``--job.config_file`` wins over ``CONFIG_FILE``, else the
debug config; ``--module``/``--config`` or ``MODULE``/``CONFIG``: a function's config, no file; ``NGPU`` processes,
2 on a machine without a GPU) and checked in process with
``torchtitan.preflight``'s entry point. A doc that shows a command training another config than it says, or
a flag that no longer exists, fails here by file and line. tests/runs/launch/test_launch_runs.py runs the script itself.
The blocks a user runs line by line (``SEQUENCES``) run in order, each line as typed but for the training lines that
another test already launches (``LAUNCHED_ELSEWHERE``): those are checked and trained in process and in the pool.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.support.pool import JobFailed, run_in_pool, train_job
from tests.support.runs import ROOT
from torchtitan.config.manager import JobConfig
from torchtitan.preflight.__main__ import _launch_flags
from torchtitan.preflight.__main__ import main as preflight_main

DEFAULT_CONFIG = "./train_configs/debug_model.toml"
# What a user sets up before the cluster configs run (each doc says so); the test stands in for it:
# a downloaded hub tokenizer (scripts/download_tokenizer.py) -> the shipped one at the same key;
SHIPPED_TOKENIZER = "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"
# a chat run's tokenizer the user builds first (docs/vision.md: scripts/build_vlm_assets.py) -> the shipped chat one
SHIPPED_CHAT_TOKENIZER = "./tests/assets/sft/tokenizer"
# a running torchft lighthouse (docs/fault_tolerance.md) -> its address in the environment (nothing connects to it);
# a local S3 server with the doc's bucket (docs/checkpoint.md) -> the tests' moto server (``local_s3``).
LIGHTHOUSE = "http://localhost:29510"
SOURCES = ["README.md", "docs/*.md", "train_configs/*.toml", "scripts/*.sh", "scripts/*.slurm"]
# a command as typed: environment assignments, then ./run_llama_train.sh (or bash run_llama_train.sh), or the
# preflight with arguments; a bare mention of the script's name in prose is not a command
_COMMAND = re.compile(
    r"^((?:[A-Z_]+=\S+\s+)*(?:bash\s+|\./)run_llama_train\.sh\b.*|python3? -m torchtitan\.preflight --.*)$"
)


def _candidates(path: str) -> list[tuple[int, str]]:
    """(line number, text) of each place a command can stand: markdown code (fenced or inline), the start of a
    comment line or of a comment's sentence elsewhere; continuation lines (a trailing backslash) joined."""
    lines = open(path).read().splitlines()
    out, fenced = [], False
    for i, line in enumerate(lines):
        if path.endswith(".md"):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            texts = [line.strip()] if fenced else re.findall(r"`([^`]+)`", line)
        elif line.lstrip().startswith("#"):
            comment = line.lstrip().lstrip("#").strip()
            texts = [comment, *(part.strip() for part in comment.split(". ")[1:])]
        else:
            continue
        for text in texts:
            j = i
            while text.endswith("\\") and j + 1 < len(lines):
                j += 1
                text = text[:-1].rstrip() + " " + lines[j].strip().lstrip("#").strip()
            text = re.sub(r"\s+\([^()]*\)$", "", text.split("  #")[0].strip())  # a trailing "(32 nodes of ...)"
            out.append((i + 1, text))
    return out


def _documented_commands() -> list[tuple[str, str]]:
    """(file:line, command) for each launch command shown in the docs."""
    found = []
    for pattern in SOURCES:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            for line_no, text in _candidates(path):
                # no templates: <dump>, "$@", a placeholder word such as --world_size N
                if _COMMAND.match(text) and not re.search(r"[<$]|\s[A-Z]+(\s|$)", text):
                    found.append((f"{os.path.relpath(path, ROOT)}:{line_no}", text))
    return found


def _preflight_argv(command: str) -> list[str]:
    """The preflight arguments run_llama_train.sh would pass for ``command`` (or the preflight's own)."""
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] in ("python", "python3"):
        return words[3:]  # python -m torchtitan.preflight ARGS
    args = words[words.index(next(w for w in words if w.endswith("run_llama_train.sh"))) + 1 :]

    def given(flag: str) -> bool:
        return any(a.startswith(f"{flag}=") or (i and args[i - 1] == flag) for i, a in enumerate(args))

    # a function's config (--module/--config, or MODULE/CONFIG where the arguments lack them) takes no TOML file
    function = [
        f
        for flag, var in (("--module", "MODULE"), ("--config", "CONFIG"))
        if not given(flag) and var in env
        for f in (flag, env[var])
    ]
    if given("--job.config_file") or given("--module") or given("--config"):
        config = function if not given("--job.config_file") else []
    else:
        config = function or ["--job.config_file", env.get("CONFIG_FILE", DEFAULT_CONFIG)]
    return ["--world_size", env.get("NGPU", "2"), *config, *args]


# --------------------------------------------------------------------------- command sequences, run in order

# The blocks a user copies and runs line by line, run by test_documented_sequence_runs_in_order the same way: in
# order, in a scratch folder that links the checkout's files (its outputs/ is the scratch's own). The one change
# from the doc: a training command trains 1 step of 1 sample a rank (`--training.steps 1 --training.batch_size 1`
# appended: what the later lines read is the files the run writes, not what it learned; the debug config's 8 x 256
# tokens a rank took ~5 s of a step on 2 cores), so a step-<N> folder a later line names, N that command's
# configured steps, is read as step-1. `python` is the interpreter running the tests.
SEQUENCES = {  # name -> (file, the start of the block's first line)
    "readme_generate_and_sft": ("README.md", "./run_llama_train.sh --checkpoint.enable_checkpoint"),
    "lora_recipe": ("docs/lora.md", "scripts/create_seed_checkpoint.sh --job.dump_folder outputs/lora_base"),
}
# A training line whose launch another test already makes through run_llama_train.sh (the same NGPU, LOG_RANK and
# config-file resolution) is not launched again (~10-20 s each on 2 cores): its pre-launch check runs in process, as
# the script runs it, and the trainer, with the arguments the script passes its ranks, trains as a job in the worker
# pool of its world size, from the scratch folder (its outputs land where the next lines look). The README's first
# line, the default run (no NGPU, no CONFIG_FILE: the script's own defaults, launched by no other test), still goes
# through the script. The start of such a line -> the test that launches it.
LAUNCHED_ELSEWHERE = {
    "./run_llama_train.sh --job.config_file train_configs/sft_debug.toml": (
        "tests/runs/launch/test_launch_runs.py::test_the_readme_sft_command_trains_the_sft_config_over_config_file"
    ),
    "NGPU=2 LOG_RANK=0 CONFIG_FILE=./train_configs/debug_model.toml bash run_llama_train.sh": (
        "tests/runs/reliability/test_reliability_runs.py (popen_train: this launch with the reliability runs' flags)"
    ),
}


def _block(path: str, first: str) -> list[tuple[int, str]]:
    """(line number, command) of each command of the fenced block whose first line starts with ``first``:
    continuation lines joined, comments kept (the shell drops them)."""
    lines = open(os.path.join(ROOT, path)).read().splitlines()
    i = next(n for n, line in enumerate(lines) if line.strip().startswith(first))
    out = []
    while not lines[i].lstrip().startswith("```"):
        j, text = i, lines[i].strip()
        while text.endswith("\\"):
            j += 1
            text = text[:-1].rstrip() + " " + lines[j].strip()
        if text:
            out.append((i + 1, text))
        i = j + 1
    return out


_IN_SEQUENCES = {f"{path}:{n}" for path, first in SEQUENCES.values() for n, _ in _block(path, first)}
# each command of a sequence runs for real below; a lone pre-launch check of it would miss the files its block's
# earlier lines make (a base model's folder)
COMMANDS = [(where, command) for where, command in _documented_commands() if where not in _IN_SEQUENCES]


def test_the_docs_show_the_commands_users_type():
    places = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/sft.md", "train_configs/sft_debug.toml", "docs/fault_tolerance.md"} <= places, places
    assert len(COMMANDS) >= 15, COMMANDS
    in_sequences = [text for path, first in SEQUENCES.values() for _, text in _block(path, first)]
    for start in LAUNCHED_ELSEWHERE:  # each still names a line of a sequence
        assert any(text.startswith(start) for text in in_sequences), start


def _stand_in_tokenizer(argv: list[str]) -> str | None:
    """The shipped tokenizer that stands in for one the user fetches or builds first (a chat run's: a chat one);
    None when the command's tokenizer is here."""
    world_size, _, args = _launch_flags(argv)  # --world_size N, --target KIND
    config = JobConfig.parse_args(args, world_size=world_size)
    if os.path.exists(os.path.join(ROOT, config.model.tokenizer_path)):
        return None
    return SHIPPED_CHAT_TOKENIZER if config.training.dataset_format == "chat" else SHIPPED_TOKENIZER


@pytest.fixture(scope="module")
def local_s3():
    """docs/checkpoint.md's local S3 server (moto's, which the doc starts before its s3:// lines): the tests' own."""
    from tests.support.s3_server import s3_server

    with s3_server() as s3:
        yield s3


def _s3_stand_in(command: str, request) -> contextlib.AbstractContextManager:
    """For a command writing to ``s3://BUCKET/...``: the local server's environment, with that bucket made (the
    doc's setup lines before it); else nothing."""
    buckets = sorted(set(re.findall(r"s3://([^/\s]+)", command)))
    if not buckets:
        return contextlib.nullcontext()
    s3 = request.getfixturevalue("local_s3")
    with s3.env():
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        for bucket in buckets:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
    return s3.env()


@pytest.mark.parametrize("where,command", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_passes_the_prelaunch_check(where, command, capsys, monkeypatch, request):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", LIGHTHOUSE)
    argv = _preflight_argv(command)
    if (stand_in := _stand_in_tokenizer(argv)) is not None:
        argv += ["--model.tokenizer_path", stand_in]
    with _s3_stand_in(command, request):
        code = preflight_main(argv)
    err = capsys.readouterr().err
    assert code == 0, f"{where}: `{command}` -> preflight {argv}: {err}"


def _trains(words: list[str]) -> bool:
    return any(w.endswith("run_llama_train.sh") for w in words) or "torchtitan.train" in words


def _train_from(rank: int, world_size: int, folder: str, argv: list[str]) -> JobFailed | None:
    """``train_job`` from ``folder`` (the scratch checkout, whose paths the command's relative paths are)."""
    os.chdir(folder)
    try:
        return train_job(rank, world_size, argv)
    finally:
        os.chdir(ROOT)  # where the pool's workers stay between jobs


def _check_and_train_in_the_pool(where: str, command: str, scratch: str, capsys) -> None:
    """A training line launched by another test: its pre-launch check (in process), then its trainer in the pool."""
    argv = _preflight_argv(command)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(scratch)
        code = preflight_main(argv)
    err = capsys.readouterr().err
    assert code == 0, f"{where}: `{command}` -> preflight {argv}: {err}"
    world_size, _, args = _launch_flags(argv)
    results = run_in_pool(_train_from, world_size, scratch, args, name=f"train {where}")
    failed = [r.error for r in results if r is not None]
    assert not failed, f"{where}: `{command}` trained in the pool: {failed[0][-3000:]}"


@pytest.mark.integration
@pytest.mark.pool(2)
@pytest.mark.parametrize("name", SEQUENCES)
def test_documented_sequence_runs_in_order(name, tmp_path, capsys):
    path, first = SEQUENCES[name]
    scratch = tmp_path / "checkout"
    scratch.mkdir()
    for entry in os.listdir(ROOT):
        if entry not in ("outputs", ".git"):
            os.symlink(os.path.join(ROOT, entry), scratch / entry)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    renamed: dict[str, str] = {}
    for line, text in _block(path, first):
        for was, now in renamed.items():
            text = re.sub(rf"\b{was}\b", now, text)
        words = shlex.split(text, comments=True)
        if words[0] in ("python", "python3"):
            words[0] = sys.executable
        if _trains(words):
            world_size, _, args = _launch_flags(_preflight_argv(shlex.join(words)))
            renamed[f"step-{JobConfig.parse_args(args, world_size=world_size).training.steps}"] = "step-1"
            words += ["--training.steps", "1", "--training.batch_size", "1"]
            if any(text.startswith(start) for start in LAUNCHED_ELSEWHERE):
                _check_and_train_in_the_pool(f"{path}:{line}", shlex.join(words), str(scratch), capsys)
                continue
        result = subprocess.run(
            ["bash", "-c", shlex.join(words)], cwd=scratch, env=env, capture_output=True, text=True, timeout=300
        )
        out = result.stdout + result.stderr
        assert result.returncode == 0, f"{path}:{line}: `{text}` exited {result.returncode}:\n{out[-3000:]}"
        assert "Traceback" not in out, f"{path}:{line}: `{text}`:\n{out[-3000:]}"
        if "generate.py" in text:  # it printed a continuation (the model is 1 step old: any text)
            assert result.stdout.strip() and "error" not in result.stderr.lower(), out[-3000:]
