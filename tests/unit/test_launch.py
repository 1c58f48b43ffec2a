"""torchtitan/launch: failure records and the launcher's summary, the run lock, storage errors,
metrics.jsonl cut mid-line, the parent watch, a lost peer and the lost-node line. Single process, no torch
import (but the lost-node line's checkpoint lookup, through the config)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from torchtitan.checkpointing.files.jsonl import read_json_lines
from torchtitan.launch import failures, run_folder
from torchtitan.launch.failures import (
    Failure,
    classify,
    read_failure,
    report_exception,
    report_failure,
    storage_error,
    summarize,
)
from torchtitan.launch.parent_watch import watch_parent
from torchtitan.launch.run_folder import FolderInUseError, RunLock, folder_problem

USER_ERRORS = (ValueError, NotImplementedError, FileNotFoundError)


class FakeCheckpointException(BaseException):
    """DCP's CheckpointException: a BaseException with ``failures = {rank: (exception, traceback)}``."""

    def __init__(self, failures: dict):
        super().__init__(f"CheckpointException ranks:{failures.keys()}")
        self.failures = failures


# --------------------------------------------------------------------------- classify / storage errors


def test_classify_user_errors_storage_errors_and_bugs():
    assert classify(ValueError("bad key"), USER_ERRORS) == ("error", "bad key", 2)
    assert classify(RuntimeError("boom"), USER_ERRORS) == ("crash", "RuntimeError: boom", 1)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/metrics.jsonl")
    label, message, code = classify(full, USER_ERRORS)
    assert (label, code) == ("error", 2)
    assert message == "No space left on device: 'out/metrics.jsonl'; free some space or choose another folder"
    ro = classify(OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/out"), USER_ERRORS)[1]
    assert ro.startswith("Read-only file system: '/ro/out'; the file system is read-only")
    assert classify(KeyboardInterrupt(), USER_ERRORS)[0] == "stopped"


def test_storage_error_inside_a_checkpoint_failure():
    """A full disk under DCP: one rank's OSError (no file name), another's short write, wrapped."""
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    ckpt = FakeCheckpointException(
        {0: (short_write, None), 1: (OSError(errno.ENOSPC, "No space left on device"), None)}
    )
    assert storage_error(ckpt) == (
        "No space left on device while writing a checkpoint; free some space or choose another folder"
    )
    try:  # the async path: RuntimeError("async save ... failed: ...") from the CheckpointException
        raise RuntimeError("async save of checkpoint step-4 failed") from ckpt
    except RuntimeError as e:
        assert "while writing a checkpoint" in storage_error(e)
    only_short = FakeCheckpointException({0: (short_write, None)})
    assert "most likely a full disk" in storage_error(only_short)
    assert storage_error(RuntimeError("shape mismatch")) is None


def test_folder_problem_without_writing(tmp_path, monkeypatch):
    assert folder_problem(str(tmp_path / "new" / "run")) is None
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert folder_problem(str(a_file / "run")) == f"'{a_file}' is a file, not a folder; choose another path"

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(run_folder.os, "statvfs", lambda path: ReadOnly())
    assert "is on a read-only file system" in folder_problem(str(tmp_path / "run"))


# --------------------------------------------------------------------------- the rank's record, the launcher's summary


def test_a_record_round_trips_and_the_rank_stays_quiet_under_our_launcher(tmp_path, monkeypatch, capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv(failures.LAUNCHER_ENV, "1")
    assert report_failure(1, "error", "data file 'x.jsonl', line 4: bad", 2) == 2
    assert capsys.readouterr().err == ""
    got = read_failure(7, str(error_file), 2, 0.0)
    assert (got.rank, got.label, got.message, got.exit_code, got.recorded) == (
        1,
        "error",
        "data file 'x.jsonl', line 4: bad",
        2,
        True,
    )
    assert json.loads(error_file.read_text())["message"]["message"] == "error: data file 'x.jsonl', line 4: bad"


def test_without_our_launcher_rank0_prints_the_line_and_a_crash_its_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(failures.LAUNCHER_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    report_failure(0, "error", "bad key", 2)
    report_failure(1, "error", "bad key", 2)
    assert capsys.readouterr().err == "error: bad key\n"
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        assert report_exception(e, 1, USER_ERRORS) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.rstrip().endswith("RuntimeError: boom")


def _f(rank, label, message, t, code=2, details="", recorded=True):
    return Failure(rank, label, message, code, t, details, recorded)


def test_summary_names_the_rank_of_the_first_error_not_the_peers_that_failed_after_it():
    lines, code = summarize(
        [
            _f(1, "error", "data file 'x.jsonl', line 44: 'text' is null", 10.0),
            _f(0, "crash", "RuntimeError: Connection closed by peer", 10.2, code=1, details="Traceback ..."),
        ]
    )
    assert lines == ["error (rank 1): data file 'x.jsonl', line 44: 'text' is null"] and code == 2


def test_summary_dedupes_identical_messages_and_keeps_distinct_ones():
    lines, code = summarize([_f(1, "error", "same", 1.1), _f(0, "error", "same", 1.0), _f(3, "error", "other", 1.2)])
    assert lines == ["error (ranks 0,1): same", "error (rank 3): other"] and code == 2
    lines, code = summarize(
        [_f(0, "stopped", "after step 5", 2.0, code=3), _f(1, "stopped", "after step 5", 2.0, code=3)]
    )
    assert lines == ["stopped (ranks 0,1): after step 5"] and code == 3


def test_summary_shows_a_crash_traceback_once():
    tb = "Traceback (most recent call last):\n  File ...\nRuntimeError: boom\n"
    lines, code = summarize(
        [_f(1, "crash", "RuntimeError: boom", 5.0, 1, tb), _f(0, "crash", "RuntimeError: boom", 5.1, 1, tb)]
    )
    assert lines == ["crash (ranks 0,1): RuntimeError: boom", tb.rstrip("\n")] and code == 1


def test_summary_of_ranks_that_left_no_record(tmp_path):
    killed = read_failure(1, str(tmp_path / "missing.json"), -signal.SIGKILL, 3.0)
    stopped_by_torchrun = read_failure(0, None, -signal.SIGTERM, 3.0)
    lines, code = summarize([stopped_by_torchrun, killed])
    assert lines == ["error (rank 1): killed by SIGKILL"] and code == 128 + signal.SIGKILL


# --------------------------------------------------------------------------- the run lock


def _write_lock(folder, **holder):
    (folder / run_folder.LOCK_FILE).write_text(json.dumps(holder))


def test_the_lock_refuses_a_second_live_run_and_is_released(tmp_path):
    first = RunLock(str(tmp_path))
    first.acquire()
    holder = json.loads((tmp_path / "run.lock").read_text())
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    _write_lock(tmp_path, host=socket.gethostname(), pid=os.getppid(), started="t0")  # a live process
    with pytest.raises(FolderInUseError, match=rf"in use by a run on host {socket.gethostname()} \(pid {os.getppid()}"):
        RunLock(str(tmp_path)).acquire()
    first.release()  # not ours any more: left alone
    assert (tmp_path / "run.lock").exists()
    (tmp_path / "run.lock").unlink()
    with RunLock(str(tmp_path)):
        assert (tmp_path / "run.lock").exists()
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_from_another_host_is_refused(tmp_path):
    _write_lock(tmp_path, host="elsewhere-node-7", pid=1, started="t0")
    with pytest.raises(FolderInUseError, match=r"host elsewhere-node-7 .* delete .*run\.lock"):
        RunLock(str(tmp_path)).acquire()


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for holder in (
        {"host": socket.gethostname(), "pid": gone.pid, "started": "t0"},  # dead pid
        {"host": socket.gethostname(), "pid": os.getpid(), "started": "t0"},  # our own pid: a restarted container
        {"host": socket.gethostname(), "pid": os.getppid(), "pid_start": "-1", "started": "t0"},  # a reused pid
    ):
        _write_lock(tmp_path, **holder)
        lock = RunLock(str(tmp_path))
        with caplog.at_level("WARNING"):
            lock.acquire()
        assert "taking over run.lock from a run that is gone" in caplog.text
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        lock.release()
        caplog.clear()


def test_an_orphaned_holder_is_waited_for(tmp_path, monkeypatch, caplog):
    """Its launcher is gone, so its parent watch stops it soon: wait for that rather than refuse."""
    monkeypatch.setattr(run_folder, "GRACE_SECONDS", 5.0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    _write_lock(tmp_path, host=socket.gethostname(), pid=orphan.pid, started="t0", launcher={"pid": gone.pid})
    start = time.monotonic()
    with caplog.at_level("WARNING"), RunLock(str(tmp_path)):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    orphan.wait()
    assert time.monotonic() - start < 5 and "whose launcher is gone; waiting up to" in caplog.text


# --------------------------------------------------------------------------- metrics.jsonl cut mid-line


def test_a_cut_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    with caplog.at_level("WARNING"):
        rows = read_json_lines(str(path))
    assert [r["step"] for _, r in rows] == [1, 2]
    assert f"{path}: dropping its last line, cut short" in caplog.text
    path.write_text('{"step": 1}')  # complete, but no newline: the next record must start a new line
    assert read_json_lines(str(path))[0][0] == '{"step": 1}\n'
    path.write_text('{"step": 1}\n\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"{path}, line 3: not a JSON record"):
        read_json_lines(str(path))


# --------------------------------------------------------------------------- the parent watch


def test_a_rank_stops_soon_after_its_launcher_dies(tmp_path):
    """A 'launcher' starts a 'rank' that watches it, then is SIGKILLed; the rank must be gone in seconds."""
    rank = textwrap.dedent(
        """
        import time
        from torchtitan.launch.parent_watch import watch_parent
        assert watch_parent(poll_seconds=0.1, grace_seconds=2)
        print("watching", flush=True)
        time.sleep(60)
        """
    )
    launcher = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {rank!r}], env=dict(os.environ, TORCHELASTIC_RUN_ID="t"),
                                 stdout=subprocess.PIPE, stderr=open({str(tmp_path / "rank.err")!r}, "w"),
                                 start_new_session=True, text=True)
        assert child.stdout.readline() == "watching\\n"
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child_pid), "the orphaned rank is still running"
    assert "the launcher (pid" in (tmp_path / "rank.err").read_text()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def test_no_watch_without_a_launcher(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_parent() is False


@pytest.mark.parametrize(
    "body, code, err",
    [("return 3", 3, ""), ("return None", 0, ""), ("raise SystemExit('bad flag')", 1, "bad flag")],
    ids=["code", "none", "system-exit-message"],
)
def test_a_rank_leaves_with_its_code_and_flushed_logs_without_finalization(body, code, err):
    """``python -m torchtitan.train``'s exit path (pytorch#179291: gloo threads can abort finalization)."""
    script = textwrap.dedent(
        f"""
        import atexit, logging, sys
        from torchtitan.launch.failures import exit_without_finalization
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
        atexit.register(lambda: print("finalized"))  # must not run: the process leaves before finalization
        def main():
            logging.info("logged before exit")
            {body}
        exit_without_finalization(main)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == code, run.stderr
    assert run.stdout.splitlines() == ["logged before exit"] and err in run.stderr, (run.stdout, run.stderr)


# --------------------------------------------------------------------------- a lost peer, a lost node


def test_a_collective_that_lost_its_peer_is_one_line_and_the_killed_rank_is_the_cause():
    from torchtitan.launch.failures import EXIT_NODE_LOST, LOST_PEER, Failure, classify, summarize

    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8608: Connection reset "
        "by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    label, message, code = classify(gloo, (ValueError,))
    assert (label, message, code) == (
        LOST_PEER,
        "a collective lost its peer: Read error [127.0.0.1]:8608: Connection reset by peer",
        EXIT_NODE_LOST,
    )
    survivor = Failure(0, label, message, code, 2.0)
    killed = Failure(1, "error", "killed by SIGKILL", 137, 1.0, recorded=False)
    lines, exit_code = summarize([survivor, killed])
    assert lines == ["error (rank 1): killed by SIGKILL"] and exit_code == 137
    assert summarize([survivor])[0] == [f"lost peer (rank 0): {message}"]


def test_the_lost_node_line_names_the_node_and_the_checkpoint(tmp_path):
    from torchtitan.launch.node_watch import LostNode, lost_node_line, resume_hint

    folder = tmp_path / "run"
    args = ["--job.config_file", "./train_configs/debug_model.toml", "--job.dump_folder", str(folder)]
    assert resume_hint("torchtitan.train", args).startswith("checkpointing is off (checkpoint.enable_checkpoint)")
    args.append("--checkpoint.enable_checkpoint")
    assert resume_hint("torchtitan.train", args) == (
        f"no complete checkpoint in {folder}/checkpoint: the same command starts again from step 0"
    )
    for step, marker in ((3, True), (6, False)):  # step-6's save did not finish
        (folder / "checkpoint" / f"step-{step}").mkdir(parents=True)
        if marker:
            (folder / "checkpoint" / f"step-{step}" / ".complete").write_text('{"kind": "full"}')
    resume = resume_hint("torchtitan.train", args)
    assert resume == f"the same command on every node resumes from checkpoint step-3 ({folder}/checkpoint/step-3)"
    assert resume_hint("tests.support.held_marker_train", args) == "restart the same command on every node"
    line = lost_node_line(LostNode("n7", 42, hosted_store=True), endpoint="10.0.0.1:29500", resume=resume)
    assert line == (
        "error: lost node n7 (launcher pid 42), which hosted the rendezvous at 10.0.0.1:29500: it stopped answering "
        f"for 3 s, so this node's ranks were stopped; {resume}"
    )
