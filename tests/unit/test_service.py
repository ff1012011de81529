"""The environment's service without root: the backoff and restart rules, the supervisor's loop
driven by scripted runs, the state file as `status` reads it, and the planner's step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from envctl.facts import HostFacts
from envctl.host.context import Host
from envctl.plan.builder import PlanError
from envctl.plan.planner import plan_env
from envctl.resources.base import Resource, Status
from envctl.resources.service import Service
from envctl.runtime import service as rs
from envctl.runtime.context import EnvCgroup, EnvContext
from envctl.runtime.jobs import identity
from envctl.spec.loader import parse_spec

REPO = Path(__file__).resolve().parents[2]
FACTS = HostFacts(cpus=(0, 1), memory_bytes=8 << 30, sysctls=frozenset({
    "net.ipv4.ip_forward", "kernel.numa_balancing", "vm.zone_reclaim_mode"}),
    groups={"users": 100})  # the shipped cpu-compute admits it
EXIT0, EXIT1, KILLED = 0, 1 << 8, signal.SIGKILL  # raw wait statuses


# ---------------------------------------------------------------- rules


def test_backoff_doubles_from_restart_sec_up_to_a_minute():
    seq, d = [], None
    for _ in range(9):
        d = rs.next_delay(d, 1.0)
        seq.append(d)
    assert seq == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    # restart_sec 0: the first restart at once, then never a spin.
    d0 = rs.next_delay(None, 0)
    assert d0 == 0 and rs.next_delay(d0, 0) == 0.1 and rs.next_delay(0.1, 0) == 0.2
    # A restart_sec above the cap is kept, not cut down.
    assert rs.next_delay(rs.next_delay(None, 120), 120) == 120


@pytest.mark.parametrize(("policy", "status", "want"), [
    ("no", EXIT1, False), ("no", KILLED, False), ("no", None, False),
    ("on-failure", EXIT0, False), ("on-failure", EXIT1, True), ("on-failure", KILLED, True),
    ("on-failure", None, True),
    ("always", EXIT0, True), ("always", EXIT1, True),
])
def test_restart_policies(policy, status, want):
    assert rs.restarts(policy, status) is want


def test_summaries_say_what_the_service_does():
    now = 1000.0
    backoff = {"state": "backoff", "restarts": 3, "next_start": 1004.0,
               "last_exit": {"code": None, "signal": 9, "error": None}}
    assert rs.summary(backoff, now) == ("restarting (3 restarts, last exit signal 9 (SIGKILL), "
                                        "next start in 4.0 s)")
    running = {"state": "running", "pid": 42, "since": now, "restarts": 0}
    assert rs.summary(running, now).startswith("running (pid 42, since ")
    assert "restart" not in rs.summary(running, now)
    failed = {"state": "failed", "restarts": 1, "restart": "no",
              "last_exit": {"code": 3, "signal": None, "error": None}}
    assert rs.summary(failed, now) == "failed: last exit exit 3 (1 restart, restart: no)"
    assert rs.describe_exit({"code": 127, "error": "x: command not found"}) == \
        "could not start: x: command not found"


# ---------------------------------------------------------------- the supervisor's loop


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def strftime(self, *a):  # summary() is not called by the loop
        raise AssertionError


class Scripted(rs._Supervisor):
    """The loop with runs scripted as (seconds it ran, raw wait status or an error) and a
    sleep that only records the delay."""

    def __init__(self, tmp: Path, clock: Clock, runs: list, restart: str, restart_sec=1.0):
        host = Host(state_dir=tmp / "state", run_dir=tmp / "run")
        (host.run_dir / "box").mkdir(parents=True)
        ctx = EnvContext(env="box", root=tmp, mntns=tmp / "mnt", netns=None, hostname="box",
                         cgroup=EnvCgroup("systemd", "", 2))
        self.report_r, w = os.pipe()
        super().__init__(host, ctx, rs.Service("box", ("svc",), restart, restart_sec), w, 10)
        self.clock, self.runs, self.slept, self.states = clock, list(runs), [], []

    def run_once(self, first):
        seconds, outcome = self.runs.pop(0)
        self.clock.now += seconds
        self.states.append(self.state["restarts"])
        if isinstance(outcome, str):
            return None, outcome, 127
        if first:
            self.tell("R")
        return outcome, None, None

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.clock.now += seconds
        return True

    def told(self) -> str:
        if self.report_fd is not None:
            self.done_telling()
        return os.read(self.report_r, 4096).decode()

    def record(self) -> dict:
        return json.loads((self.dir / rs.STATE_FILE).read_text())


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(rs, "time", c)
    return c


def test_on_failure_backs_off_doubling_resets_after_a_long_run_and_stops_at_exit_0(
        tmp_path, clock):
    sup = Scripted(tmp_path, clock, [(1, EXIT1), (1, KILLED), (1, EXIT1), (40, EXIT1),
                                     (1, EXIT1), (1, EXIT0)], "on-failure")
    sup.run()
    assert sup.slept == [1, 2, 4, 1, 2]  # the 40 s run reset the backoff
    assert sup.states == [0, 1, 2, 3, 4, 5]
    rec = sup.record()
    assert rec["state"] == "stopped" and rec["restarts"] == 5
    assert rec["last_exit"] == {"code": 0, "signal": None, "error": None}
    assert rec["supervisor"] == identity() and rec["pid"] is None
    assert sup.told() == f"P {os.getpid()}\nR\n"


def test_restart_no_ends_failed_after_the_first_run(tmp_path, clock):
    sup = Scripted(tmp_path, clock, [(1, KILLED)], "no")
    sup.run()
    rec = sup.record()
    assert sup.slept == [] and rec["state"] == "failed" and rec["restarts"] == 0
    assert rec["last_exit"]["signal"] == signal.SIGKILL


def test_always_restarts_a_clean_exit_and_a_stop_request_ends_the_backoff(tmp_path, clock):
    sup = Scripted(tmp_path, clock, [(1, EXIT0), (1, EXIT0)], "always", restart_sec=0)

    def sleep(seconds):
        sup.slept.append(seconds)
        sup.stopping = len(sup.slept) == 2  # SIGTERM during the second backoff
        return not sup.stopping
    sup.sleep = sleep
    sup.run()
    assert sup.slept == [0, 0.1]
    assert sup.record()["state"] == "stopped" and sup.record()["restarts"] == 1


def test_a_first_launch_that_fails_is_reported_and_not_retried(tmp_path, clock):
    sup = Scripted(tmp_path, clock, [(0, "x: command not found in environment 'box'")],
                   "always")
    sup.run()
    assert sup.told().splitlines()[-1] == "E 127 x: command not found in environment 'box'"
    assert sup.record()["state"] == "failed" and sup.slept == []


def test_a_later_launch_failure_is_a_failure_under_on_failure(tmp_path, clock):
    sup = Scripted(tmp_path, clock, [(1, EXIT1), (0, "enter environment 'box': setns mnt"),
                                     (1, EXIT0)], "on-failure")
    sup.run()
    assert sup.slept == [1, 2] and sup.record()["state"] == "stopped"


# ---------------------------------------------------------------- the resource


def write_state(host: Host, **fields) -> None:
    d = host.run_dir / "box"
    d.mkdir(parents=True, exist_ok=True)
    state = {"env": "box", "command": ["svc", "-x"], "restart": "on-failure",
             "restart_sec": 1.0, "supervisor": identity(), "boot_id": host.boot_id,
             "state": "running", "pid": 4242, "restarts": 0, "since": 0, "cgroup": None}
    state.update(fields)
    (d / rs.STATE_FILE).write_text(json.dumps(state))


@pytest.fixture
def host(tmp_path):
    return Host(state_dir=tmp_path / "state", run_dir=tmp_path / "run")


RES = Service("box", ("svc", "-x"), "on-failure", 1.0)


def test_check_reads_the_supervisor_from_its_record(host):
    assert RES.check(host).status is Status.ABSENT  # nothing recorded
    write_state(host)  # this test process stands in for a live supervisor
    check = RES.check(host)
    assert check.status is Status.PRESENT and check.detail.startswith("running (pid 4242")
    write_state(host, state="backoff", restarts=4, next_start=0,
                last_exit={"code": 1, "signal": None, "error": None})
    check = RES.check(host)
    assert check.status is Status.PRESENT
    assert check.detail.startswith("restarting (4 restarts, last exit exit 1")
    other = Service("box", ("svc", "-y"), "always", 1.0)
    drift = other.check(host)
    assert drift.status is Status.DRIFTED
    assert {d.field for d in drift.diffs} == {"command", "restart"}


def test_a_dead_or_reused_or_other_boot_supervisor_is_absent(host):
    me = identity()
    write_state(host, supervisor={"pid": me["pid"], "start": me["start"] + 1})  # a reused pid
    assert RES.check(host).status is Status.ABSENT
    assert "is gone" in RES.check(host).detail
    write_state(host, boot_id="another-boot")
    assert RES.check(host).status is Status.ABSENT
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    write_state(host, supervisor={"pid": int(dead), "start": 1}, state="failed",
                last_exit={"code": 3, "signal": None, "error": None}, restart="no")
    check = RES.check(host)
    assert check.status is Status.ABSENT and "failed: last exit exit 3" in check.detail


def test_stop_of_a_dead_supervisor_drops_its_record_and_nothing_at_all_is_fine(host):
    rs.stop(host, "box")  # nothing recorded: nothing to do
    write_state(host, supervisor={"pid": 1, "start": -1})  # not ours: never signalled
    rs.stop(host, "box")
    assert not (host.run_dir / "box" / rs.STATE_FILE).exists()
    RES.remove(host, {})  # again: success


def test_round_trip_through_the_journal_form():
    assert Resource.from_dict(RES.to_dict()) == RES
    assert RES.key == "service:box" and RES.volatile


# ---------------------------------------------------------------- the plan


def test_the_service_is_the_last_step_and_no_longer_a_warning():
    spec = parse_spec((REPO / "configs" / "cpu-compute.yaml").read_text(), "c.yaml").spec
    plan = plan_env(spec, FACTS)
    last = plan.resources[-1]
    assert isinstance(last, Service) and last.env == "cpu-compute"
    assert last.command == tuple(spec.service.command) and last.restart == "on-failure"
    assert not any("validated" in w for w in plan.warnings)
    bare = parse_spec("name: x\nkind: cpu\nrootfs: {binaries: [sh]}\n", "x.yaml").spec
    assert not any(r.kind == "service" for r in plan_env(bare, FACTS).resources)


def test_a_service_without_a_rootfs_is_a_plan_error():
    spec = parse_spec("name: x\nkind: cpu\nservice: {command: [sleep, '1']}\n", "x.yaml").spec
    with pytest.raises(PlanError) as err:
        plan_env(spec, FACTS)
    assert [loc for loc, _ in err.value.issues] == [("service",)]


def test_the_runtime_module_never_imports_the_engine():
    code = ("import sys, envctl.runtime.service, envctl.resources.service\n"
            "print(sorted(m for m in sys.modules if m.startswith('envctl.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")}, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_log_rotation_never_leaves_the_name_absent(tmp_path, monkeypatch, keep):
    """A reader tailing service.log by name (`tail -F`, the suite's waits) must find it at
    every step of a rotation: the old file is linked as .1 and a new one renamed over it."""
    sup = object.__new__(rs._Supervisor)
    sup.dir, sup.log_fd, sup.log_max, sup.log_keep, sup.state = tmp_path, -1, 250, keep, {}
    log = tmp_path / rs.LOG_FILE
    seen, began = [], []
    for name in ("replace", "link", "unlink", "open"):
        real = getattr(os, name)

        def check(*args, _real=real, **kwargs):
            seen.append(bool(began) and not log.exists())  # absent after the first write
            return _real(*args, **kwargs)
        monkeypatch.setattr(os, name, check)
    r, w = os.pipe()
    try:
        written = b""
        for i in range(12):
            line = f"{i:03d}".encode() + b"x" * 96 + b"\n"
            os.write(w, line)
            written += line
            assert sup.copy_out(r) == len(line)
            began.append(True)
            seen.append(not log.exists())
    finally:
        monkeypatch.undo()
        os.close(r)
        os.close(w)
        os.close(sup.log_fd)
    assert not any(seen)
    files = [log.with_name(f"{rs.LOG_FILE}.{n}") for n in range(keep, 0, -1)] + [log]
    kept = b"".join(p.read_bytes() for p in files)
    assert written.endswith(kept) and len(log.read_bytes()) <= 250
    assert len(kept) == 200 * (keep + 1)  # two lines a file
    assert not log.with_name(f"{rs.LOG_FILE}.{keep + 1}").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)


def test_a_service_its_policy_ended_stays_ended_for_the_monitor_only(host):
    """`restart: no` ended (or on-failure after exit 0): the monitor's check finds nothing to
    heal; `status` and `up` (no monitor option) still find it missing, and `up` starts it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    no = Service("box", ("svc", "-x"), "no", 1.0)
    write_state(host, supervisor={"pid": int(dead), "start": 1}, state="failed", ended="policy",
                last_exit={"code": 3, "signal": None, "error": None}, restart="no")
    assert no.check(host).status is Status.ABSENT  # status, up
    host.options["monitor"] = "1"
    check = no.check(host)
    assert check.status is Status.PRESENT and "ended as its policy says" in check.detail
    assert "failed: last exit exit 3" in check.detail
    # Not ended by its policy (its supervisor was killed, or another boot's record): healed.
    write_state(host, supervisor={"pid": int(dead), "start": 1}, state="running",
                restart="no")
    assert no.check(host).status is Status.ABSENT
    write_state(host, supervisor={"pid": int(dead), "start": 1}, state="stopped",
                ended="policy", boot_id="another-boot", restart="no")
    assert no.check(host).status is Status.ABSENT
