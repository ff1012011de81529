"""The job queue on the real kernel: `jobs.max_running: 1` keeps a second job PENDING
(MaxRunning, shown by `envctl jobs`) until the first ends, then it runs, both COMPLETED; two
`--cpus 1` jobs on a 1-CPU environment: the second PENDING (Resources), then it runs; `cancel`
of a PENDING job ends it CANCELLED, never started, its staged program gone; `down` with a
pending job needs --force; kill -9 of the daemon with 50 jobs queued and 2 running: after a
restart all 52 end COMPLETED.

A job is held running by a gate: it waits for a file `go` in its own directory (bound at /job
inside), which the test creates; every wait is for a condition, with a generous bound."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration.sandbox import stderr_of
from tests.integration.test_jobs import script

pytestmark = pytest.mark.root

SPEC = """
name: qbox
kind: cpu
rootfs:
  binaries: [sh, sleep, "true"]
resources:
  cpu: {dedicated: "0"}
  memory: {max: 64M}
jobs:
  max_running: LIMIT
"""

GATE = "#!/bin/sh\nwhile [ ! -e /job/go ]; do sleep 0.05; done\necho passed\n"


def up(sb, limit: int = 1000) -> None:
    sb.write_spec("qbox", SPEC.replace("LIMIT", str(limit)))
    res = sb.envctl("up", "qbox")
    assert res.returncode == 0, res.stderr


def submit(sb, *args: str, env: dict[str, str] | None = None) -> dict:
    res = sb.envctl("submit-job", "--json", "--user", "root", "qbox", *args, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def record(sb, jid: int) -> dict:
    return json.loads((sb.state / "jobs" / f"{jid}.json").read_text())


def until(what: str, check, timeout: float = 120.0):
    """check()'s first true value, looked at every 50 ms for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"not {what} after {timeout:g} s"
        time.sleep(0.05)


def open_gate(sb, jid: int) -> None:
    (sb.state / "jobs" / str(jid) / "go").write_text("")


def listed(sb, env: dict[str, str] | None = None) -> dict[int, dict]:
    res = sb.envctl("jobs", "--json", env=env)
    assert res.returncode == 0, res.stderr
    return {j["id"]: j for j in json.loads(res.stdout)}


@pytest.fixture
def qbox(sandbox):
    yield sandbox
    if sandbox.proc.poll() is None:
        sandbox.envctl("down", "qbox", "--force")


def test_max_running_keeps_the_second_job_pending_until_the_first_ends(qbox):
    sb = qbox
    up(sb, limit=1)
    gate = script(sb, "gate.sh", GATE)
    first = submit(sb, gate)
    assert first["state"] == "RUNNING", first
    second = submit(sb, "true")
    assert (second["state"], second["queued"], second["reason"]) == (
        "PENDING", True, "MaxRunning"), second
    assert second["start_time"] is None
    table = sb.envctl("jobs").stdout
    row = next(r for r in table.splitlines() if r.split()[0] == str(second["id"]))
    assert "PENDING" in row and "(MaxRunning)" in row, table
    assert listed(sb)[second["id"]]["reason"] == "MaxRunning"
    open_gate(sb, first["id"])
    res = sb.envctl("wait", "--json", str(first["id"]), str(second["id"]), timeout=300)
    assert res.returncode == 0, res.stderr
    ended = json.loads(res.stdout)
    assert [j["state"] for j in ended] == ["COMPLETED", "COMPLETED"], ended
    # The second started only once the first had ended.
    assert ended[1]["start_time"] >= ended[0]["end_time"], ended
    assert not (sb.state / "jobs" / ".queue" / "qbox").exists()


def test_a_second_cpu_waits_for_the_only_one(qbox):
    sb = qbox
    up(sb)
    gate = script(sb, "gate.sh", GATE)
    first = submit(sb, "--cpus", "1", gate)
    assert (first["state"], first["cpus"], first["cpus_exclusive"]) == ("RUNNING", [0], True)
    second = submit(sb, "--cpus", "1", "true")
    assert (second["state"], second["reason"], second["cpus"]) == ("PENDING", "Resources", [])
    # It stays so while the CPU is held (passes of the queue meanwhile change nothing).
    res = sb.envctl("submit-job", "--json", "--user", "root", "qbox", "--cpus", "1", "true")
    third = json.loads(res.stdout)
    assert (third["state"], listed(sb)[third["id"]]["reason"]) == ("PENDING", "Priority")
    assert record(sb, second["id"])["state"] == "PENDING"
    open_gate(sb, first["id"])
    res = sb.envctl("wait", "--json", *(str(j["id"]) for j in (first, second, third)),
                    timeout=300)
    assert res.returncode == 0, res.stderr
    ended = json.loads(res.stdout)
    assert [j["state"] for j in ended] == ["COMPLETED"] * 3, ended
    assert [j["cpus"] for j in ended] == [[0]] * 3
    assert ended[1]["start_time"] >= ended[0]["end_time"], ended


def test_cancel_of_a_pending_job_and_down_with_one_pending(qbox):
    sb = qbox
    up(sb, limit=1)
    gate = script(sb, "gate.sh", GATE)
    first = submit(sb, gate)
    waiting = submit(sb, gate)  # staged: a program of this host
    assert waiting["state"] == "PENDING"
    staged = sb.state / "jobs" / str(waiting["id"])
    assert (staged / "gate.sh").is_file()
    res = sb.envctl("cancel", str(waiting["id"]))
    assert res.returncode == 0, res.stderr
    rec = record(sb, waiting["id"])
    assert (rec["state"], rec["start_time"], rec["queued"]) == ("CANCELLED", None, False), rec
    assert not staged.exists() and not (sb.state / "jobs" / f"{waiting['id']}.req").exists()
    assert waiting["id"] not in listed(sb)
    # Another one waits: down says so and refuses; --force cancels both.
    third = submit(sb, "true")
    res = sb.envctl("down", "qbox")
    assert res.returncode == 3, res.stderr
    assert "1 job(s) still running and 1 job(s) pending in its queue" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = sb.envctl("down", "qbox", "--force")
    assert res.returncode == 0, res.stderr
    assert [record(sb, j["id"])["state"] for j in (first, third)] == ["CANCELLED"] * 2
    assert record(sb, third["id"])["start_time"] is None


def test_52_jobs_end_completed_across_a_killed_daemon(qbox, tmp_path):
    sb = qbox
    up(sb, limit=2)
    sock = {"ENVCTL_SOCKET": str(tmp_path / "envctl.sock")}

    def start_daemon():
        daemon = sb.popen(sys.executable, "-m", "envctl", "daemon", env=sock)
        until("the daemon answering", lambda: _answers(daemon, sock["ENVCTL_SOCKET"]), 60)
        return daemon

    daemon = start_daemon()
    try:
        gate = script(sb, "gate.sh", GATE)
        held = [submit(sb, gate, env=sock) for _ in range(2)]
        assert [j["state"] for j in held] == ["RUNNING"] * 2
        queued = [submit(sb, "true", env=sock) for _ in range(50)]
        assert {j["state"] for j in queued} == {"PENDING"}
        shown = listed(sb, sock)
        assert {shown[j["id"]]["reason"] for j in queued} <= {"MaxRunning"}
        daemon.kill()
        daemon.wait(30)
        # No daemon: the gates open, the running jobs end, and their supervisors move the
        # queue on; a new daemon finds what is left and serves the rest.
        for j in held:
            open_gate(sb, j["id"])
        daemon = start_daemon()
        ids = [str(j["id"]) for j in held + queued]
        res = sb.envctl("wait", "--json", *ids, env=sock, timeout=600)
        assert res.returncode == 0, res.stderr
        ended = json.loads(res.stdout)
        assert [j["state"] for j in ended] == ["COMPLETED"] * 52, [
            (j["id"], j["state"], j.get("error")) for j in ended if j["state"] != "COMPLETED"]
        # Never more than two at once.
        spans = sorted((j["start_time"], j["end_time"]) for j in ended)
        for i, (start, _) in enumerate(spans):
            assert sum(1 for s, e in spans[:i] if e > start) <= 1, spans
        assert not (sb.state / "jobs" / ".queue" / "qbox").exists()
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(30)
    assert not Path(sock["ENVCTL_SOCKET"]).exists()


def _answers(daemon, path: str) -> bool:
    """Whether the daemon accepts a connection on `path` (root's `envctl jobs` would succeed
    in-process without one, and prove nothing); its stderr when it died."""
    import socket

    if daemon.poll() is not None:
        pytest.fail(stderr_of(daemon))
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(path)
        except OSError:
            return False
        return True


def _asleep(pid: int) -> bool:
    """`pid` sleeping in clock_nanosleep (x86_64 syscall 230): time.sleep of a wait for a
    queued job's record (queue.open_when_started), nothing a start-up or a refusal does."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[0] == "230"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@pytest.mark.parametrize("through", ["in-process", "daemon"])
def test_logs_follow_of_a_pending_job_waits_for_its_start(qbox, tmp_path, through):
    sb = qbox
    up(sb, limit=1)
    sock = {"ENVCTL_SOCKET": str(tmp_path / "envctl.sock")}
    daemon = None
    if through == "daemon":
        daemon = sb.popen(sys.executable, "-m", "envctl", "daemon", env=sock)
        until("the daemon answering", lambda: _answers(daemon, sock["ENVCTL_SOCKET"]), 60)
    try:
        gate = script(sb, "gate.sh", GATE)
        first = submit(sb, gate, env=sock)
        assert first["state"] == "RUNNING", first
        second = submit(sb, script(sb, "hello.sh", "#!/bin/sh\necho hello-from-second\n"),
                        env=sock)
        assert (second["state"], second["queued"]) == ("PENDING", True), second
        res = sb.envctl("logs", str(second["id"]), env=sock)
        assert (res.returncode, res.stdout) == (1, ""), res
        assert "PENDING (MaxRunning): no output yet" in res.stderr, res.stderr
        follower = sb.popen(sys.executable, "-m", "envctl", "logs", "-f", str(second["id"]),
                            env=sock)
        try:
            # The one waiting: the command itself, or the daemon's worker for its request.
            def waiting() -> bool:
                if follower.poll() is not None:
                    pytest.fail(f"logs -f ended early: {follower.returncode}: "
                                f"{stderr_of(follower)}")
                if daemon is None:
                    return _asleep(follower.pid)
                kids = Path(f"/proc/{daemon.pid}/task/{daemon.pid}/children").read_text()
                return any(_asleep(int(k)) for k in kids.split())
            until("logs -f waiting for the job to start", waiting, 60)
            assert record(sb, second["id"])["state"] == "PENDING"
            open_gate(sb, first["id"])
            out, err = follower.communicate(timeout=300)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait(30)
        assert (follower.returncode, out) == (0, "hello-from-second\n"), err
        assert record(sb, second["id"])["state"] == "COMPLETED"
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.terminate()
            daemon.wait(30)


def test_logs_follow_of_a_pending_job_cancelled_says_why(qbox):
    sb = qbox
    up(sb, limit=1)
    gate = script(sb, "gate.sh", GATE)
    first = submit(sb, gate)
    second = submit(sb, "true")
    assert second["state"] == "PENDING", second
    follower = sb.popen(sys.executable, "-m", "envctl", "logs", "-f", str(second["id"]))
    try:
        until("logs -f waiting", lambda: _asleep(follower.pid)
              or (follower.poll() is not None and pytest.fail(stderr_of(follower))), 60)
        res = sb.envctl("cancel", str(second["id"]))
        assert res.returncode == 0, res.stderr
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(30)
    assert (follower.returncode, out) == (1, ""), err
    assert f"job {second['id']} ended CANCELLED without starting" in err, err
    open_gate(sb, first["id"])
    assert sb.envctl("wait", str(first["id"]), timeout=120).returncode == 0


# A pass of the queue, as the daemon's timer runs one (supervisor.kick).
KICK = ("from envctl.host.context import Host; from envctl.runtime.supervisor import kick; "
        "kick(Host.from_env())")


def _kick_lock_free(sb) -> bool:
    """No pass runs now: nobody holds `<state>/jobs/.kick` (a killed claimer let it go)."""
    import fcntl
    import os

    fd = os.open(sb.state / "jobs" / ".kick", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _holding(flag: Path) -> list[int]:
    """The processes whose environment names `flag` (ENVCTL_FAULT's until=): the supervisor
    held at its takeover, once its claimer is gone."""
    import os

    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                if str(flag).encode() in (d / "environ").read_bytes():
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("step", ["listed", "record", "index", "start", "own"])
def test_a_claim_whose_claimer_is_killed_goes_back_to_the_queue_and_runs_once(qbox, tmp_path,
                                                                              step):
    """kill -9 of the process that claims a queued job (the pass in the ending supervisor's
    child), at each step of its claim: in the holders' index, its record claimed, the queue's
    index rewritten, about to spawn the supervisor, and with the new supervisor spawned but
    not yet its owner (held there, its claimer killed). The job is shown PENDING, never
    LOST; the next pass puts it back in the queue and starts it; it runs exactly once (a line
    per run in a data mount), and the held supervisor, let go, starts nothing."""
    import os
    import signal

    sb = qbox
    data = sb.root / "data"
    data.mkdir(mode=0o755)
    runs = data / "runs"
    runs.write_text("")
    runs.chmod(0o666)
    sb.write_spec("qbox", SPEC.replace("LIMIT", "1")
                  + f"mounts:\n  - {{source: \"{data}\", target: /srv}}\n")
    res = sb.envctl("up", "qbox")
    assert res.returncode == 0, res.stderr
    gate = script(sb, "gate.sh", GATE)
    counted = script(sb, "counted.sh", '#!/bin/sh\necho "$1" >> /srv/runs\n')
    flag = tmp_path / "own"
    fault = f"until={flag}@claim:own" if step == "own" else f"kill@claim:{step}"
    # The first job's supervisor (and the pass its child runs when it ends) has the fault.
    first = submit(sb, gate, env={"ENVCTL_FAULT": fault})
    assert first["state"] == "RUNNING", first
    second = submit(sb, counted, "second")
    assert (second["state"], second["reason"]) == ("PENDING", "MaxRunning"), second
    jid = second["id"]
    open_gate(sb, first["id"])
    if step == "own":
        until("the new supervisor held before its takeover",
              lambda: Path(f"{flag}.waiting").exists())
        claimer = record(sb, jid)["supervisor"]["pid"]
        os.kill(claimer, signal.SIGKILL)
        until("the claimer gone", lambda: _kick_lock_free(sb))
    elif step == "listed":
        held = sb.state / "jobs" / ".held"
        until("the claim listed, its claimer killed", lambda: held.exists()
              and jid in json.loads(held.read_text() or "[]") and _kick_lock_free(sb))
        assert record(sb, jid)["queued"] is True
    else:
        until("the claim recorded, its claimer killed",
              lambda: record(sb, jid).get("claimed") and _kick_lock_free(sb))
    assert record(sb, first["id"])["state"] == "COMPLETED"
    assert runs.read_text() == ""
    # Shown waiting in the queue, not LOST.
    assert listed(sb)[jid]["state"] == "PENDING"
    # The next pass (here as the daemon's timer runs it) puts it back and starts it.
    res = sb.run(sys.executable, "-c", KICK)
    assert res.returncode == 0, res.stderr
    if step == "own":
        held_up = _holding(flag)
        assert held_up, "the held supervisor is gone"
        flag.write_text("")
        until("the held supervisor gone", lambda: not any(p in _holding(flag)
                                                          for p in held_up))
    res = sb.envctl("wait", "--json", str(first["id"]), str(jid), timeout=300)
    assert res.returncode == 0, res.stderr
    ended = json.loads(res.stdout)
    assert [j["state"] for j in ended] == ["COMPLETED", "COMPLETED"], ended
    assert runs.read_text() == "second\n"
    rec = record(sb, jid)
    assert (rec["claimed"], rec["queued"]) == (False, False), rec
    assert not (sb.state / "jobs" / f"{jid}.req").exists()
    assert not (sb.state / "jobs" / ".queue" / "qbox").exists()
