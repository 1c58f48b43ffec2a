"""Checkpoints in an object store, on one process, against a real S3-compatible server (moto's, on localhost,
tests/support/s3_server.py): the same CRC32s and restricted loading as on disk, the marker written last, retention and
set-aside by copy + delete; the pre-launch check's one-line refusals (exit 2) for what cannot work.

The multi-rank runs (FSDP2 saving to s3://, a crash before the marker, resuming on another layout) are
tests/runs/checkpoint/test_remote_checkpoint_runs.py.
"""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch

from tests.support.checkpoint import DATA, Pwn, tiny_linear
from tests.support.checkpoint import linear_manager as _integrity_manager
from tests.support.s3_server import BUCKET, s3_server
from torchtitan.checkpointing.common import load_model_weights, save_model_weights
from torchtitan.checkpointing.files import integrity, storage
from torchtitan.checkpointing.files.folders import SET_ASIDE, list_checkpoints
from torchtitan.checkpointing.files.marker import MARKER, read_marker, step_folder
from torchtitan.checkpointing.manager import CheckpointManager
from torchtitan.preflight.__main__ import main as preflight

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
INFO = {"name": "linear", "flavor": None, "args": {"dim": 64}}


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture
def root(s3, request) -> str:
    """A fresh prefix of the bucket, with the server's endpoint and dummy credentials in the environment."""
    with s3.env():
        yield f"s3://{BUCKET}/{request.node.name}"


def _manager(dump_folder, folder: str, model: torch.nn.Module, **config) -> CheckpointManager:
    """test_checkpoint_integrity's one-process manager, its checkpoint.folder a URL."""
    return _integrity_manager(dump_folder, model, folder=folder, **config)


def _objects(url: str) -> list[str]:
    fs, path = storage.filesystem(url)
    return sorted(p[len(path) + 1 :] for p in fs.find(path))


def test_which_paths_are_urls():
    assert storage.is_url("s3://b/p") and storage.is_url("gs://b/p")
    assert not storage.is_url("/tmp/x") and not storage.is_url("file:///tmp/x")
    assert storage.under("out", "checkpoint") == os.path.join("out", "checkpoint")
    assert storage.under("out", "s3://b/run/ckpt") == "s3://b/run/ckpt"  # not joined to the dump folder
    assert storage.under("out", "file:///data/ckpt") == "/data/ckpt"


def test_a_seed_in_a_bucket_records_crcs_taken_while_writing_and_loads_back(root, tmp_path):
    """What create_seed_checkpoint writes, into a bucket; read back whole, and as a run's initial_load_path."""
    path = step_folder(root, 0)
    weights = tiny_linear(0).state_dict()
    save_model_weights(weights, path, INFO)
    assert _objects(path) == [MARKER, ".metadata", DATA, DATA + integrity.SIDECAR_SUFFIX]
    recorded = read_marker(path)["files"]
    fs, key = storage.filesystem(path)
    data = fs.cat_file(f"{key}/{DATA}")
    assert recorded[DATA] == [len(data), integrity.zlib.crc32(data)]  # the writer's, not -1
    loaded, _ = load_model_weights(path)
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    started = tiny_linear(1)
    assert _manager(tmp_path, "checkpoint", started, initial_load_path=path).load() == 0
    assert all(torch.equal(a, b) for a, b in zip(weights.values(), started.state_dict().values()))


def test_a_changed_object_and_a_foreign_pickle_are_refused(root, tmp_path):
    path = step_folder(root, 0)
    save_model_weights(tiny_linear(0).state_dict(), path, INFO)
    fs, key = storage.filesystem(path)
    data = bytearray(fs.cat_file(f"{key}/{DATA}"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{key}/{DATA}", bytes(data))
    with pytest.raises(ValueError, match=rf"checkpoint {path} is corrupted: {DATA} does not match its CRC32"):
        load_model_weights(path)
    target = tmp_path / "pwned"
    fs.pipe_file(f"{key}/.metadata", pickle.dumps(Pwn(str(target))))
    with pytest.raises(integrity.ForeignPickleError, match="posix.system, which is not DCP metadata"):
        integrity.read_metadata_file(f"{path}/.metadata")
    assert not target.exists()


def test_the_manager_saves_resumes_purges_and_sets_aside_in_a_bucket(root, tmp_path):
    """Async saves at 2 and 4 with keep_latest_k 1: step-2 is deleted (marker first) once step-4 is complete;
    an unmarked step-6 (a crash before its marker) is never loaded; load_step 2 moves step-4 aside by copy."""
    saved = tiny_linear(0)
    manager = _manager(tmp_path, root, saved, async_mode="async", keep_latest_k=1)
    manager.save(2)
    manager.save(4)
    manager.close()
    assert [(c.step, c.complete) for c in list_checkpoints(root)] == [(4, True)]
    fs, key = storage.filesystem(root)
    fs.pipe_file(f"{key}/step-6/.metadata", b"not loaded")  # data written, no marker
    loaded = tiny_linear(1)
    assert _manager(tmp_path, root, loaded).load() == 4
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(ValueError, match=r"step-6 is incomplete \(no \.complete marker"):
        _manager(tmp_path, root, tiny_linear(1), load_step=6).load()

    manager = _manager(tmp_path, root, tiny_linear(0))
    manager.save(2)
    manager.close()
    assert _manager(tmp_path, root, tiny_linear(1), load_step=2).load() == 2
    assert [(c.step, c.complete) for c in list_checkpoints(root)] == [(2, True), (6, False)]
    (aside,) = [p for p in _objects(root) if p.startswith(SET_ASIDE) and p.endswith(MARKER)]
    assert aside.startswith(f"{SET_ASIDE}/abandoned-after-resume-from-step-2-") and aside.endswith("/step-4/.complete")
    assert read_marker(f"{root}/{os.path.dirname(aside)}")["step"] == 4


def test_a_marker_the_store_refuses_to_read_is_an_error_not_an_incomplete_checkpoint(root, s3):
    path = step_folder(root, 0)
    save_model_weights(tiny_linear(0).state_dict(), path, INFO)
    s3.require_auth(True)
    try:
        with pytest.raises(ValueError, match=r"step-0: its \.complete marker could not be read: PermissionError"):
            read_marker(path)
    finally:
        s3.require_auth(False)


CHECKPOINT_IN = ["--checkpoint.enable_checkpoint", "--checkpoint.folder"]


def test_the_pre_launch_check_writes_a_probe_and_passes(root, capsys):
    assert preflight([*CHECKPOINT_IN, root]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    assert _objects(root) == []  # the probe object is deleted again


@pytest.mark.parametrize("case", ["missing bucket", "bad credentials", "no credentials", "s3fs missing"])
def test_the_pre_launch_check_refuses_a_store_it_cannot_write_in_one_line(case, s3, capsys, monkeypatch):
    url = f"s3://{'no-such-bucket' if case == 'missing bucket' else BUCKET}/run"
    expected = {
        "missing bucket": "cannot be written: The specified bucket does not exist (create the bucket, or fix the URL)",
        "bad credentials": "cannot be written: access denied (The AWS Access Key Id you provided does not exist in "
        "our records.); check the credentials s3:// reads from the environment",
        "no credentials": "cannot be written: NoCredentialsError: Unable to locate credentials",
        "s3fs missing": "needs the s3fs package (fsspec's s3:// filesystem), which is not installed here: "
        "pip install s3fs",
    }[case]
    unset = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None} if case == "no credentials" else {}
    if case == "s3fs missing":
        monkeypatch.setitem(sys.modules, "s3fs", None)  # what an import finds where it is not installed
    with s3.env(**unset):
        s3.require_auth(case == "bad credentials")
        try:
            code = preflight([*CHECKPOINT_IN, url])
        finally:
            s3.require_auth(False)
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith(f"error: checkpoint.folder = '{url}' {expected}") and err.count("\n") == 1, err
    assert "testing" not in err  # the (dummy) key is never printed


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["--job.dump_folder", "s3://b/run"],
            "job.dump_folder = 's3://b/run' is a URL, and a run writes its own files there locally",
        ),
        (
            ["--checkpoint.initial_load_path", "s3://b/hf", "--checkpoint.initial_load_in_hf"],
            "checkpoint.initial_load_path = 's3://b/hf' with checkpoint.initial_load_in_hf = true: a Hugging Face "
            "folder is read from local files",
        ),
        (
            [*CHECKPOINT_IN, "nosuch://b/run"],
            "checkpoint.folder = 'nosuch://b/run' has a protocol fsspec does not know ('nosuch://'",
        ),
    ],
    ids=["dump-folder-url", "hf-from-url", "unknown-protocol"],
)
def test_what_cannot_be_a_url_is_refused_in_one_line(args, expected, capsys):
    assert preflight(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {expected}") and err.count("\n") == 1, err
