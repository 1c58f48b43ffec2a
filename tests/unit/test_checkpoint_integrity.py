"""Checkpoint integrity on one process: CRC32s taken while writing, verified on load; foreign pickles refused."""

from __future__ import annotations

import json
import os
import pickle
import zlib

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tests.support.checkpoint import DATA, Pwn, linear_manager, tiny_linear
from tests.support.scripts import script_main
from torchtitan.checkpointing.common import load_model_weights, save_model_weights
from torchtitan.checkpointing.files import integrity
from torchtitan.checkpointing.files.folders import list_files
from torchtitan.checkpointing.files.marker import MARKER, read_marker, step_folder, write_marker

# one process on purpose: DCP says it assumes one process on every call
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _seed_checkpoint(tmp_path) -> str:
    path = step_folder(str(tmp_path / "ckpt"), 0)
    save_model_weights(tiny_linear(0).state_dict(), path, {"name": "linear", "flavor": None, "args": {"dim": 64}})
    return path


def _flip_middle_byte(path: str) -> None:
    with open(path, "r+b") as f:
        middle = os.path.getsize(path) // 2
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))


def _assert_crcs_match_the_bytes(path: str) -> None:
    files = read_marker(path)["files"]
    assert DATA in files and ".metadata" in files
    assert not any(name.endswith(integrity.SIDECAR_SUFFIX) for name in files)  # consumed into the marker
    for name, (size, crc) in files.items():
        data = open(os.path.join(path, name), "rb").read()
        assert (size, crc) == (len(data), zlib.crc32(data)), name


def test_marker_records_the_crc32_taken_while_writing(tmp_path):
    path = _seed_checkpoint(tmp_path)
    _assert_crcs_match_the_bytes(path)
    sidecar = json.load(open(os.path.join(path, DATA + integrity.SIDECAR_SUFFIX)))
    assert sidecar["crc32"] == read_marker(path)["files"][DATA][1]


def test_async_save_records_crc32s_too(tmp_path):
    manager = linear_manager(tmp_path, tiny_linear(0), async_mode="async")
    manager.save(2)
    manager.close()
    _assert_crcs_match_the_bytes(step_folder(str(tmp_path / "ckpt"), 2))


def test_a_genuine_checkpoint_loads_back_equal_tensors(tmp_path):
    saved = tiny_linear(0)
    manager = linear_manager(tmp_path, saved)
    manager.save(2)
    manager.close()
    loaded = tiny_linear(1)
    assert linear_manager(tmp_path, loaded).load() == 2
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path):
    manager = linear_manager(tmp_path, tiny_linear(0))
    manager.save(2)
    path = step_folder(str(tmp_path / "ckpt"), 2)
    _flip_middle_byte(os.path.join(path, DATA))
    refusal = rf"checkpoint {path} is corrupted: {DATA} does not match its CRC32 .*checkpoint.load_step"
    with pytest.raises(ValueError, match=refusal):
        linear_manager(tmp_path, tiny_linear(1)).load()
    with pytest.raises(ValueError, match=refusal):
        load_model_weights(path)
    assert script_main("dcp_to_torch")([path, str(tmp_path / "out.pt")]) == 2


def test_without_checksums_the_size_check_stays(tmp_path):
    path = _seed_checkpoint(tmp_path)
    data = os.path.join(path, DATA)
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ValueError, match=rf"{DATA} has {size - 10} bytes, the save wrote {size}"):
        linear_manager(tmp_path, tiny_linear(1), verify_checksums=False).load()
    with pytest.raises(ValueError, match=rf"{DATA} has {size - 10} bytes"):
        load_model_weights(path, verify_checksums=False)


def test_markers_without_data_crcs_still_load(tmp_path):
    """A marker written before CRCs were taken while writing records -1 for data files: size only."""
    path = _seed_checkpoint(tmp_path)
    marker = read_marker(path)
    marker["files"][DATA][1] = -1
    os.remove(os.path.join(path, DATA + integrity.SIDECAR_SUFFIX))
    write_marker(path, 0, marker.pop("kind"), **{k: v for k, v in marker.items() if k not in ("step", "time")})
    weights, _ = load_model_weights(path)
    assert torch.equal(weights["weight"], tiny_linear(0).weight)
    assert list_files(path)[DATA][1] == -1  # no sidecar: the size alone would be recorded (with a warning)


def _plant_foreign_metadata(path: str, target: str) -> None:
    """Replace ``.metadata`` with a code-running pickle and re-mark the folder, as a crafted checkpoint would."""
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Pwn(target), f)
    marker = read_marker(path)
    write_marker(path, marker["step"], marker["kind"], model=marker["model"], files=list_files(path))


def test_a_foreign_pickle_in_metadata_is_refused_without_running_it(tmp_path):
    manager = linear_manager(tmp_path, tiny_linear(0))
    manager.save(2)
    path = step_folder(str(tmp_path / "ckpt"), 2)
    target = str(tmp_path / "pwned")
    _plant_foreign_metadata(path, target)
    refusal = (
        rf"checkpoint {path}/.metadata holds a pickle of (posix|nt|os)\.system, which is not DCP metadata; "
        r"refusing to load it \(it could run code\)"
    )
    with pytest.raises(ValueError, match=refusal):
        linear_manager(tmp_path, tiny_linear(1)).load()
    with pytest.raises(ValueError, match=refusal):
        load_model_weights(path)
    # dcp.load's own read (torch 2.11's DCP hides the reader's error: integrity.load raises it itself)
    with pytest.raises(
        (CheckpointException, integrity.ForeignPickleError), match=r"holds a pickle of (posix|nt|os)\.system"
    ):
        integrity.load({"model": tiny_linear(1).state_dict()}, path, no_dist=True)
    for model_only in ([], ["--model-only"]):
        assert script_main("dcp_to_torch")([path, str(tmp_path / "out.pt"), *model_only]) == 2
    assert not os.path.exists(target)


def test_a_foreign_pickle_in_a_non_tensor_entry_is_refused_without_running_it(tmp_path):
    target = str(tmp_path / "pwned")
    path = str(tmp_path / "crafted")
    integrity.save({"extra": {"note": Pwn(target)}}, path, no_dist=True)  # pickled at save time, not run
    assert os.path.isfile(os.path.join(path, MARKER)) is False and not os.path.exists(target)
    refusal = r"checkpoint entry extra.note is not plain data; refusing to load it .*GLOBAL (posix|nt|os)\.system"
    with pytest.raises(CheckpointException, match=refusal):
        integrity.load({"extra": {"note": None}}, path, no_dist=True)
    assert not os.path.exists(target)
    plain = str(tmp_path / "plain")
    integrity.save({"extra": {"note": "plain text", "lr": 0.1}}, plain, no_dist=True)
    state = {"extra": {"note": "", "lr": 0.0}}
    integrity.load(state, plain, no_dist=True)  # plain values pass the weights-only check
    assert state["extra"] == {"note": "plain text", "lr": 0.1}
