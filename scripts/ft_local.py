"""Fault tolerance on one machine (docs/fault_tolerance.md), behind scripts/ft_local.sh.

A torchft lighthouse and REPLICA_GROUPS replica groups of NGPU ranks each, every group an ordinary
./run_llama_train.sh launch in its own process group. Replica group KILL_GROUP is SIGKILLed once it has logged
step KILL_STEP, then restarted with the same command: it heals from a live group and rejoins, and all of them
finish at the last step on the same weights.

Nothing here races wall time: the script pauses the other groups (SIGSTOP to their rank 0, which stalls their
steps and heartbeats) while a group starts, while the group is killed and while it restarts, and a held group
that reaches RESERVE steps before the last one stays stopped until the newcomer is up, so on a loaded machine
the survivors can neither finish before the restarted group is back nor skip the steps they train alone. Each
job starts in an empty dump folder (an earlier job's files move to ``earlier_runs/<when>/``), and the script
checks its own claims at the end, exiting 1 with one line naming the claim that failed:

* every group exited 0;
* each survivor started once and logged each of its steps once, in order, to the last one;
* a survivor trained without the killed group after the kill;
* the restarted group healed from a live group at a step after the kill;
* every group ended at the same step with the same weights digest.

``scripts/ft_local.sh --check DUMP`` checks a finished job's folder again (what ``ft_local.json`` recorded and
the groups' logs) without running anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECORD = "ft_local.json"
WAIT_S = 600  # every wait ends by then: a stuck group fails the script instead of hanging it
POLL_S = 0.01
HELD_S, LET_S = 0.4, 0.1  # a held group's heartbeats stay well within the lighthouse's 2 s timeout
# Steps a held group keeps in hand: once it has logged step `steps - RESERVE` it stays stopped until the newcomer's
# Manager is up (its heartbeats may lapse meanwhile: harmless, it rejoins at its next quorum); then the lighthouse
# holds each of its quorums up to its 3 s join timeout for the newcomer, so the steps left after a LET_S slice's
# overshoot (a few on a tiny model) leave the newcomer seconds to ask for its first one. Without the cap a slow
# start lost the race (a CI run, 2026-11-28: group 0 trained its last 22 steps at the held pace before the
# restarted group was up, leaving none to heal from).
RESERVE = 8


def usage_error(message: str) -> NoReturn:
    """A user error: one line, exit code 2 (as run_llama_train.sh's)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class ClaimFailed(Exception):
    """One of the script's claims does not hold: the message is the one line it prints."""


@dataclass
class Settings:
    groups: int
    ranks: int
    kill_group: int
    kill_step: int
    port: int
    dump: Path
    steps: int  # the run's training.steps and metrics.log_freq (the config the groups train)
    log_freq: int

    @property
    def held_cap(self) -> int:
        """A held group that has logged this step (it may be log_freq - 1 further) keeps RESERVE steps in hand."""
        return self.steps - RESERVE - (self.log_freq - 1)

    @classmethod
    def from_env(cls, overrides: list[str]) -> Settings:
        def positive(name: str, default: int, allow: tuple[int, ...] = ()) -> int:
            raw = os.environ.get(name, str(default))
            if not re.fullmatch(r"-?[0-9]+", raw) or (int(raw) < 1 and int(raw) not in allow):
                extra = " or " + ", ".join(map(str, allow)) if allow else ""
                usage_error(f"{name} = '{raw}': must be a positive integer{extra}")
            return int(raw)

        groups = positive("REPLICA_GROUPS", 2)
        kill_group = positive("KILL_GROUP", 1, allow=(0, -1))
        if kill_group >= groups:
            usage_error(f"KILL_GROUP = '{kill_group}': must be -1 (none) or a group 0..{groups - 1}")
        ranks = positive("NGPU", 1)
        steps, log_freq = trained_steps(overrides, ranks)
        s = cls(
            groups=groups,
            ranks=ranks,
            kill_group=kill_group,
            kill_step=positive("KILL_STEP", 10),
            port=positive("PORT", 29510),
            dump=Path(os.environ.get("DUMP", "./outputs/ft_local")),
            steps=steps,
            log_freq=log_freq,
        )
        if s.kill_group >= 0 and s.kill_step >= s.held_cap:
            usage_error(
                f"KILL_STEP = {s.kill_step} with training.steps {s.steps} and metrics.log_freq {s.log_freq}: the "
                f"survivors keep their last {s.steps - s.held_cap} steps for the restarted group to heal into; set "
                f"KILL_STEP < {s.held_cap} or train more steps"
            )
        return s


def trained_steps(overrides: list[str], ranks: int) -> tuple[int, int]:
    """``training.steps`` and ``metrics.log_freq`` of the config the groups will train (run_llama_train.sh's file
    choice: a --job.config_file argument, else CONFIG_FILE, else the debug model's)."""
    from torchtitan.config.manager import JobConfig

    argv = list(overrides)
    if not any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in argv):
        argv = ["--job.config_file", os.environ.get("CONFIG_FILE", "./train_configs/debug_model.toml"), *argv]
    try:
        config = JobConfig.parse_args(argv, world_size=ranks)
    except (ValueError, OSError) as e:  # ConfigError is a ValueError; a missing file an OSError
        usage_error(str(e))
    return config.training.steps, max(1, config.metrics.log_freq)


@dataclass
class Record:
    """What the job did, in ``$DUMP/ft_local.json``: what ``--check`` reads back."""

    groups: int
    kill_group: int
    killed_after: int = 0  # the killed group's last logged step
    survivors_at: int = 0  # the survivors' last logged step when it was killed
    exit_codes: dict[str, int | None] | None = None


# --------------------------------------------------------------------------- what the groups wrote


def console(dump: Path, group: int) -> str:
    path = dump / f"replica_{group}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def logged(dump: Path, group: int) -> list[dict]:
    path = dump / f"replica_{group}" / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            records.append(json.loads(line))
    return records


def last_step(dump: Path, group: int) -> int:
    records = logged(dump, group)
    return records[-1]["step"] if records else 0


def starts(text: str, group: int) -> list[re.Match]:
    return list(re.finditer(rf"fault tolerance: replica group {group} of \d+ \(\d+ ranks?, pid (\d+)\)", text))


def ft_lines(text: str) -> list[str]:
    return [line.split("]:", 1)[-1] for line in text.splitlines() if "fault tolerance" in line]


# --------------------------------------------------------------------------- the claims


def check(dump: Path) -> str:
    """The job's claims, from its record and the groups' files; the summary line, or ClaimFailed."""
    path = dump / RECORD
    if not path.exists():
        raise ClaimFailed(f"{path} does not exist: not a folder scripts/ft_local.sh ran a job in")
    record = Record(**json.loads(path.read_text()))
    codes = record.exit_codes or {}
    bad = {g: c for g, c in codes.items() if c != 0}
    if bad or len(codes) != record.groups:
        group, code = next(iter(bad.items())) if bad else ("?", None)
        raise ClaimFailed(f"replica group {group} exited with {code}: see {dump / f'replica_{group}.log'}")
    ends = {}
    for g in range(record.groups):
        text = console(dump, g)
        done = re.findall(r"replica group \d+ done at step (\d+) with groups \[[\d, ]+\]; weights digest (\w+)", text)
        if not done:
            raise ClaimFailed(f"replica group {g} never logged its last step's weights digest: see its log")
        ends[g] = done[-1]
        if g == record.kill_group:
            continue
        if (launches := len(starts(text, g))) != 1:
            raise ClaimFailed(f"replica group {g} started {launches} times, not once")
        steps = [r["step"] for r in logged(dump, g)]
        if steps != sorted(set(steps)) or not steps or steps[-1] != int(done[-1][0]):
            raise ClaimFailed(f"replica group {g} did not log each step once, in order, to the last: {steps}")
    if record.kill_group >= 0:
        k = record.kill_group
        alone = [
            r["step"]
            for g in range(record.groups)
            if g != k
            for r in logged(dump, g)
            if r["step"] > record.survivors_at and r.get("replica_groups") == record.groups - 1
        ]
        if not alone:
            raise ClaimFailed(f"no group trained without replica group {k} after it was killed")
        restarted = console(dump, k)
        launches = starts(restarted, k)
        tail = restarted[launches[-1].start() :] if len(launches) >= 2 else ""
        healed = re.findall(rf"replica group {k} healed from group (\d+) at step (\d+)", tail)
        if not healed:
            raise ClaimFailed(f"replica group {k} did not heal from a live group after its restart: see its log")
        source, at = int(healed[0][0]), int(healed[0][1])
        if at <= record.killed_after:
            raise ClaimFailed(f"replica group {k} healed at step {at}, not after the kill (step {record.killed_after})")
    if len(set(ends.values())) != 1:
        shown = ", ".join(f"group {g}: step {s} digest {d}" for g, (s, d) in ends.items())
        raise ClaimFailed(f"the groups ended on different weights: {shown}")
    step, digest = next(iter(ends.values()))
    if record.kill_group < 0:
        return f"ok: {record.groups} groups ended at step {step} on the same weights (digest {digest}); none killed"
    return (
        f"ok: replica group {record.kill_group} killed after step {record.killed_after}, the others trained on "
        f"alone, it healed from group {source} at step {at}; all {record.groups} groups ended at step {step} on the "
        f"same weights (digest {digest})"
    )


# --------------------------------------------------------------------------- the job


@contextlib.contextmanager
def signalled(pids: list[int], first: signal.Signals, last: signal.Signals) -> Iterator[None]:
    """Send ``first`` to ``pids``, ``last`` on exit (a process that died meanwhile is skipped)."""
    send(pids, first)
    try:
        yield
    finally:
        send(pids, last)


def stopped(pids: list[int]) -> contextlib.AbstractContextManager[None]:
    """SIGSTOP ``pids``, SIGCONT on exit."""
    return signalled(pids, signal.SIGSTOP, signal.SIGCONT)


def resumed(pids: list[int]) -> contextlib.AbstractContextManager[None]:
    """SIGCONT stopped ``pids``, SIGSTOP them again on exit."""
    return signalled(pids, signal.SIGCONT, signal.SIGSTOP)


def send(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it exited since its pid was read
            os.kill(pid, sig)


class Job:
    def __init__(self, settings: Settings, overrides: list[str]):
        self.s = settings
        self.overrides = overrides
        self.launchers: dict[int, subprocess.Popen] = {}

    def start(self, group: int) -> None:
        env = dict(os.environ, NGPU=str(self.s.ranks))
        cmd = ["bash", str(ROOT / "run_llama_train.sh"), "--job.dump_folder", str(self.s.dump)]
        cmd += ["--fault_tolerance.enable", "--fault_tolerance.group_size", str(self.s.groups)]
        cmd += ["--fault_tolerance.replica_id", str(group), *self.overrides]
        with open(self.s.dump / f"replica_{group}.log", "a") as out:  # a restart appends
            self.launchers[group] = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        print(f"replica group {group}: pid {self.launchers[group].pid} (log {self.s.dump}/replica_{group}.log)")

    def rank0(self, group: int, nth: int | None = None) -> int | None:
        """The pid of the group's rank 0 once its Manager is up in its ``nth`` launch (default: its latest) (torchrun
        starts ranks in sessions of their own: a signal to the launcher's process group does not reach them)."""
        found = starts(console(self.s.dump, group), group)
        nth = len(found) if nth is None else nth
        return int(found[nth - 1].group(1)) if 0 < nth <= len(found) else None

    def wait(self, what: str, done: Callable[[], bool], watch: tuple[int, ...] = ()) -> None:
        """Until ``done()``; ClaimFailed if a watched group's launcher ends first or WAIT_S passes."""
        deadline = time.monotonic() + WAIT_S
        while not done():
            for g in watch:
                if self.launchers[g].poll() is not None:
                    raise ClaimFailed(
                        f"replica group {g} exited ({self.launchers[g].returncode}) while waiting for {what}: see "
                        f"{self.s.dump}/replica_{g}.log"
                    )
            if time.monotonic() > deadline:
                raise ClaimFailed(f"no {what} within {WAIT_S} s")
            time.sleep(POLL_S)

    @contextlib.contextmanager
    def paused(self, groups: list[int]) -> Iterator[None]:
        """SIGSTOP these groups' rank 0 (their steps and heartbeats stop; the other ranks wait in collectives),
        SIGCONT on exit: each stays one run, every step once."""
        with stopped([pid for g in groups if (pid := self.rank0(g))]):
            yield

    def join(self, newcomers: list[int], running: list[int]) -> None:
        """Start the newcomers while the running groups are held back: stopped (SIGSTOP to rank 0) for HELD_S of
        every HELD_S + LET_S, so they train at a fraction of their speed but keep heartbeating to the lighthouse,
        and stopped for good once near their last step (``held_cap``). Once a newcomer's Manager is up, the
        lighthouse holds the running groups' next quorum until it joins: it heals from them at its first step, and
        none of them can finish before it is back, however slow its start."""
        nths = {g: len(starts(console(self.s.dump, g), g)) + 1 for g in newcomers}
        for g in newcomers:
            self.start(g)

        def up() -> bool:
            return all(self.rank0(g, nth) is not None for g, nth in nths.items())

        self.wait_held_back(
            f"replica groups {newcomers}' start", up, held=running, watch=tuple(newcomers), cap=self.s.held_cap
        )

    def wait_held_back(
        self, what: str, done: Callable[[], bool], held: list[int], watch: tuple[int, ...], cap: int | None = None
    ) -> None:
        """``wait`` for ``what`` with the ``held`` groups stopped for HELD_S of every HELD_S + LET_S (see ``join``);
        a held group that has logged step ``cap`` or a later one stays stopped until ``what`` is done."""
        pids = {g: pid for g in held if (pid := self.rank0(g))}
        deadline = time.monotonic() + WAIT_S
        with stopped(list(pids.values())):
            while not done():
                self.wait_a_while(what, HELD_S, done, watch=watch)
                let = [pid for g, pid in pids.items() if cap is None or last_step(self.s.dump, g) < cap]
                with resumed(let):
                    self.wait_a_while(what, LET_S, done, watch=watch)
                if time.monotonic() > deadline:
                    raise ClaimFailed(f"no {what} within {WAIT_S} s")

    def wait_a_while(self, what: str, seconds: float, done: Callable[[], bool], watch: tuple[int, ...]) -> None:
        """``wait`` for ``what``, but at most ``seconds``."""
        end = time.monotonic() + seconds
        self.wait(what, lambda: done() or time.monotonic() > end, watch)

    def kill(self, group: int) -> None:
        rank0 = self.rank0(group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.launchers[group].pid, signal.SIGKILL)  # what a user's kill of the job does
        if rank0 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank0, signal.SIGKILL)  # and its rank at once (its parent watch would take ~1 s)
        self.launchers[group].wait(timeout=WAIT_S)

    def run(self, record: Record) -> None:
        s, groups = self.s, range(self.s.groups)
        self.join([0], running=[])
        self.join(list(groups[1:]), running=[0])
        if s.kill_group >= 0:
            k, others = s.kill_group, [g for g in groups if g != s.kill_group]
            self.wait(f"replica group {k}'s step {s.kill_step}", lambda: last_step(s.dump, k) >= s.kill_step, (k,))
            with self.paused(others):  # they wait while it dies: none can finish before it is back
                self.kill(k)
                record.killed_after = last_step(s.dump, k)
                record.survivors_at = max(last_step(s.dump, g) for g in others)
                print(f"killed replica group {k} after step {record.killed_after} (SIGKILL to its process group)")

            def trained_alone() -> bool:
                rows = (r for g in others for r in logged(s.dump, g))
                return any(r["step"] > record.survivors_at and r["replica_groups"] == s.groups - 1 for r in rows)

            # held back while they show a step alone: on a tiny model they could otherwise finish every step before
            # the restarted group is up, leaving it no live group to heal from (a CI run: 30 steps in 4 s)
            self.wait_held_back(f"a step without replica group {k}", trained_alone, held=others, watch=tuple(others))
            print(f"restarting replica group {k} with the same command")
            self.join([k], running=others)
        record.exit_codes = {str(g): self.launchers[g].wait(timeout=WAIT_S) for g in groups}

    def stop(self) -> None:
        for p in self.launchers.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)


def set_aside_earlier_job(dump: Path) -> None:
    """An earlier job's files move to ``earlier_runs/<when it started>/``: this job starts empty, none is lost."""
    from torchtitan.checkpointing.files.marker import EARLIER_RUNS

    earlier = [p for p in dump.iterdir() if p.name != EARLIER_RUNS] if dump.exists() else []
    if not earlier:
        return
    started = min(p.stat().st_mtime for p in earlier)
    target = dump / EARLIER_RUNS / time.strftime("run-%Y-%m-%dT%H-%M-%S", time.localtime(started))
    target.mkdir(parents=True, exist_ok=True)
    for p in earlier:
        shutil.move(str(p), str(target / p.name))
    print(f"moved the earlier job in {dump} to {target}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        if len(argv) != 2:
            usage_error("scripts/ft_local.sh --check DUMP takes one folder, one this script ran a job in")
        try:
            print(f"ft_local: {check(Path(argv[1]))}")
        except ClaimFailed as e:
            print(f"ft_local: FAILED: {e}", file=sys.stderr)
            return 1
        return 0
    from torchtitan.features.fault_tolerance.lighthouse import start_lighthouse

    overrides = argv or ["--training.steps", "60"]
    settings = Settings.from_env(overrides)
    # Groups sharing one machine's cores must not each spin a thread per core (30x slower per step measured).
    threads = max(1, (os.cpu_count() or 1) // (settings.groups * settings.ranks))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    set_aside_earlier_job(settings.dump)
    settings.dump.mkdir(parents=True, exist_ok=True)
    # The lighthouse forms a quorum of whichever groups are up; a group silent for 2 s is dropped from it.
    try:
        lighthouse, address = start_lighthouse(
            1, settings.port, join_timeout_ms=3_000, heartbeat_timeout_ms=2_000, quorum_tick_ms=100
        )
    except ImportError:
        usage_error('torchft is not installed: install the fault-tolerance extra, pip install -e ".[ft]"')
    except RuntimeError as e:
        usage_error(f"{e} (PORT={settings.port}: is another job using it?)")
    os.environ["TORCHFT_LIGHTHOUSE"] = address
    print(f"lighthouse at {address} (pid {lighthouse.pid}); dump folder {settings.dump}")
    record = Record(groups=settings.groups, kill_group=settings.kill_group)
    job = Job(settings, overrides)
    failed = None
    try:
        job.run(record)
    except ClaimFailed as e:
        failed = e
    finally:
        job.stop()
        lighthouse.kill()
        lighthouse.wait(timeout=10)
        (settings.dump / RECORD).write_text(json.dumps(asdict(record), indent=1))
    for g in range(settings.groups):
        print(f"--- replica group {g}: its fault-tolerance lines")
        print("\n".join(ft_lines(console(settings.dump, g))))
    try:
        if failed is not None:
            raise failed
        print(f"ft_local: {check(settings.dump)}")
    except ClaimFailed as e:
        print(f"ft_local: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
