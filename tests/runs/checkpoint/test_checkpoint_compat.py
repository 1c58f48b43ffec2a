"""Checkpoints written by earlier releases resume with the current code (docs/checkpoint.md, "Compatibility").

Every asset in tests/assets/checkpoints (tests/support/checkpoint_assets.py: dense, MoE, LoRA, Muon, fault tolerance with
DiLoCo (where torchft is installed), an indexed blend) is
copied into a fresh dump folder and resumed by the current code with the arguments assets.json records, nothing
added (one worker-pool process each, a few seconds; the dense one also through run_llama_train.sh, as
docs/checkpoint.md tells a user): the losses after the resume step equal the ones the writing run logged, bit for bit
where this machine's fingerprint is recorded, within the matrix's RTOL elsewhere (another CPU kind rounds
differently; said once in the terminal summary, as the golden rows do).

A copy with a renamed key (what a code change that renames a parameter without an upgrade step would meet) and a
copy that claims a newer format fail in one line naming the format and the release.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import warnings
import zlib

import pytest

from tests.support.checkpoint_assets import (
    ASSETS,
    RESUME_STEP,
    argv,
    asset_folder,
    checkpoint_root,
    losses_after,
    read_index,
    run,
    run_folder,
)
from tests.support.golden import fingerprint
from tests.support.matrix import RTOL
from tests.support.runs import ROOT, check_job, launch_jobs

pytestmark = [pytest.mark.integration, pytest.mark.pool(1)]

RENAMED = ("model.tok_embeddings.weight", "model.token_embeddings.weight")


def _copy(name: str, folder: str) -> str:
    """Asset ``name`` as the resume point of a run in ``folder``; returns the copied step folder."""
    dest = os.path.join(checkpoint_root(name, folder), f"step-{RESUME_STEP}")
    shutil.copytree(asset_folder(name), dest)
    return dest


def _rewrite_metadata(step_folder: str, edit) -> None:
    """Apply ``edit`` to the copy's DCP metadata and record the new file's size and CRC in its marker, as a save
    by code that wrote those keys would have."""
    from torchtitan.checkpointing.files.integrity import read_metadata_file

    metadata = edit(read_metadata_file(os.path.join(step_folder, ".metadata")))
    data = pickle.dumps(metadata)
    with open(os.path.join(step_folder, ".metadata"), "wb") as f:
        f.write(data)
    marker_path = os.path.join(step_folder, ".complete")
    with open(marker_path) as f:
        marker = json.load(f)
    marker["files"][".metadata"] = [len(data), zlib.crc32(data)]
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def _rename_key(metadata):
    old, new = RENAMED
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    metadata.storage_data = {
        (type(i)(new, i.offset, i.index) if i.fqn == old else i): info for i, info in metadata.storage_data.items()
    }
    return metadata


def _newer_format(step_folder: str) -> None:
    marker_path = os.path.join(step_folder, ".complete")
    with open(marker_path) as f:
        marker = json.load(f)
    marker.update(format=marker["format"] + 1, release="99.0")
    with open(marker_path, "w") as f:
        json.dump(marker, f)


def _recorded_argv(name: str, folder: str) -> list[str]:
    """The arguments assets.json records for asset ``name`` (nothing added: they must be complete), into ``folder``."""
    return [*read_index()["assets"][name]["argv"], "--job.dump_folder", folder]


def _assert_recorded_losses(name: str, got: dict[str, float]) -> None:
    """``got`` equals the losses assets.json records for ``name``: bit for bit on a recorded machine, else within
    RTOL (with a warning)."""
    recorded = read_index()["assets"][name]["losses"]
    if fingerprint() in recorded:
        assert got == recorded[fingerprint()], f"{name}: resumed losses {got} vs recorded {recorded[fingerprint()]}"
        return
    want = next(iter(recorded.values()))
    warnings.warn(
        f"{name}: no losses recorded on this machine ({fingerprint()}); compared within rtol {RTOL}", stacklevel=2
    )
    assert got.keys() == want.keys(), (got, want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= RTOL * abs(loss), f"{name} step {step}: {got[step]} vs recorded {loss}"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, str]:
    """Every asset resumed by the current code, plus the two refused copies; name -> dump folder."""
    base = tmp_path_factory.mktemp("compat")
    folders = {name: str(base / name) for name in [*ASSETS, "renamed", "newer"]}
    jobs: list = []
    for name in ASSETS:
        _copy(name, folders[name])
        if name != "ft":  # the ft one needs its lighthouse: below
            jobs.append(_recorded_argv(name, folders[name]))
    _rewrite_metadata(_copy("dense", folders["renamed"]), _rename_key)
    _newer_format(_copy("dense", folders["newer"]))
    for name, error in (("renamed", "format 1, written by torchtitan"), ("newer", "is in a newer format (format 2")):
        jobs.append({"argv": _recorded_argv("dense", folders[name]), "expect_error": error})
    launch = launch_jobs(1, jobs, str(base / "jobs.json"))
    for name in folders:
        if name != "ft":
            check_job(name, folders[name], launch)
    if "ft" in ASSETS and importlib.util.find_spec("torchft") is not None:
        assert run("ft", folders["ft"]) is None
    return folders


@pytest.mark.parametrize("name", sorted(ASSETS))
def test_an_old_checkpoint_resumes_with_its_recorded_losses(name, resumed):
    if name == "ft" and importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft (the ft extra) is not installed")
    with open(os.path.join(run_folder(name, resumed[name]), "rank0.log")) as f:
        log = f.read()
    assert f"resumed from step {RESUME_STEP}" in log, log[-2000:]
    _assert_recorded_losses(name, losses_after(run_folder(name, resumed[name]), RESUME_STEP))


def test_a_shipped_checkpoint_resumes_through_the_launcher_with_its_recorded_arguments_alone(tmp_path):
    """docs/checkpoint.md's command: the dense asset copied into a dump folder, run_llama_train.sh with the arguments
    assets.json records and nothing else; the recorded losses, and no word of another tokenizer (the marker records
    the writing machine's path; the tokenizer is compared by content)."""
    folder = str(tmp_path / "old")
    _copy("dense", folder)
    env = dict(os.environ, NGPU="1", LOG_RANK="0")
    env.pop("CONFIG_FILE", None)
    launch = subprocess.run(
        ["bash", "./run_llama_train.sh", *_recorded_argv("dense", folder)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = launch.stdout + launch.stderr
    assert launch.returncode == 0, out[-3000:]
    assert f"resumed from step {RESUME_STEP}" in out, out[-3000:]
    assert "other data than it was trained on" not in out and "tokenizer_path" not in out, out[-3000:]
    _assert_recorded_losses("dense", losses_after(folder, RESUME_STEP))


@pytest.mark.parametrize("name", ["renamed", "newer"])
def test_a_changed_checkpoint_is_one_line_naming_its_format(name, resumed):
    with open(os.path.join(resumed[name], "job_status.json")) as f:
        error = json.load(f)["error"].strip().splitlines()[-1]  # the pool keeps the traceback; the launcher prints this
    assert error.startswith("ValueError: checkpoint "), error
    if name == "renamed":
        assert f"checkpoint keys this model does not have, e.g. ['{RENAMED[1][len('model.') :]}']" in error, error
        assert "format 1, written by torchtitan 0.1.0" in error, error
    else:
        assert "this torchtitan (0.1.0) reads formats 0-1; resume it with torchtitan 99.0 or later" in error, error


def test_every_asset_records_its_format_and_release():
    index = read_index()
    assert sorted(index["assets"]) == sorted(ASSETS)
    for name in ASSETS:
        assert index["assets"][name]["argv"] == argv(name), name  # the complete arguments that wrote it
        with open(os.path.join(asset_folder(name), ".complete")) as f:
            marker = json.load(f)
        assert (marker["format"], marker["release"]) == (index["format"], index["release"]), name
