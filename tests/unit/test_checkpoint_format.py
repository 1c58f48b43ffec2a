"""The checkpoint format's version (torchtitan/checkpointing/files/format.py): what a marker records, the upgrade steps
that rename an older format's keys at load time, and the refusals of formats this release does not read."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import torchtitan.checkpointing.files.format as fmt
from tests.support.checkpoint_assets import asset_folder
from torchtitan.checkpointing.common import load_model_weights
from torchtitan.checkpointing.files.integrity import read_metadata_file
from torchtitan.checkpointing.files.marker import FULL, read_marker, write_marker


def test_a_marker_records_the_format_and_the_release(tmp_path):
    write_marker(str(tmp_path), 3, FULL)
    marker = read_marker(str(tmp_path))
    assert (marker["format"], marker["release"]) == (fmt.FORMAT_VERSION, fmt.release())
    assert fmt.describe(marker) == f"format {fmt.FORMAT_VERSION}, written by torchtitan {fmt.release()}"


def test_an_unversioned_marker_reads_as_format_0_and_loads():
    assert fmt.format_of({"step": 1}) == fmt.UNVERSIONED
    fmt.check_readable({"step": 1}, "x")  # format 0 -> 1 renames nothing


@pytest.fixture
def format_2(monkeypatch):
    """This release as if it wrote format 2, reached from 1 by renaming the embedding."""
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 2)
    step = fmt.Upgrade(renames={"model.tok_embeddings.": "model.embed.", "optimizer.state.tok_embeddings.": "x."})
    monkeypatch.setitem(fmt.UPGRADES, 1, step)


def test_an_upgrade_step_renames_an_older_formats_keys_where_they_are_read(format_2):
    metadata = read_metadata_file(os.path.join(asset_folder("dense"), ".metadata"))
    keys = set(metadata.state_dict_metadata)
    assert "model.embed.weight" in keys and "model.tok_embeddings.weight" not in keys
    assert "x.weight.exp_avg" in keys
    assert {i.fqn for i in metadata.storage_data} == keys  # the data is found under the new names
    weights, _ = load_model_weights(asset_folder("dense"))
    assert weights["embed.weight"].shape == (336, 32) and torch.isfinite(weights["embed.weight"]).all()


def test_a_current_format_is_not_renamed(format_2, tmp_path):
    copy = str(tmp_path / "step-2")
    shutil.copytree(asset_folder("dense"), copy)
    marker = read_marker(copy)
    with open(os.path.join(copy, ".complete"), "w") as f:
        json.dump({**marker, "format": 2}, f)
    assert "model.tok_embeddings.weight" in read_metadata_file(os.path.join(copy, ".metadata")).state_dict_metadata


def test_a_format_no_step_reaches_names_the_release_that_reads_it(monkeypatch):
    monkeypatch.setattr(fmt, "FORMAT_VERSION", 3)
    monkeypatch.setitem(fmt.READ_BY, 1, "0.4.2")
    monkeypatch.setattr(fmt, "release", lambda: "0.5.0")
    with pytest.raises(ValueError) as e:
        fmt.check_readable({"format": 1, "release": "0.1.0"}, "ck/step-9")
    assert str(e.value) == (
        "checkpoint ck/step-9 is in a format this release no longer reads (format 1, written by torchtitan 0.1.0); "
        "this torchtitan (0.5.0) reads formats 0-3; resume it with torchtitan 0.4.2, or convert it there to a "
        "weights-only export (checkpoint.model_weights_only) to start a new run here"
    )


def test_a_newer_format_names_the_release_that_wrote_it():
    with pytest.raises(
        ValueError, match=r"newer format \(format 9, written by torchtitan 9.0\).*torchtitan 9.0 or later"
    ):
        fmt.check_readable({"format": 9, "release": "9.0"}, "ck/step-1")
