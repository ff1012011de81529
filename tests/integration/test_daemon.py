"""The daemon end to end on the real kernel, with real host users made for the test inside the
sandbox's own mount namespace (temp copies of /etc/passwd and /etc/group bound over the real
ones there, never edited): a user in access.submit submits without sudo and the job runs as
that uid; a user not in it is refused; another user cannot cancel, read the logs of or wait for
it; `--user root` from a non-admin is refused; a symlink to /etc/shadow as the program is
never copied; kill -9 of the daemon with a job running leaves it running to COMPLETED and a
restarted daemon serves it; a non-root user without a daemon gets the one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.sandbox import stderr_of

pytestmark = pytest.mark.root

ALICE, BOB, CAROL, TEAM = 60001, 60002, 60003, 60010
SPEC = """
name: box
kind: cpu
rootfs:
  binaries: [sh, "true", python3]
  python: true
resources:
  memory: {max: 64M}
access:
  submit: {users: [alice]}
  operate: {users: [carol]}
"""


class Team:
    def __init__(self, sb, shared: Path):
        self.sb = sb
        self.shared = shared
        self.socket = str(shared / "envctl.sock")
        self.daemon = None

    def start(self, env: dict[str, str] | None = None) -> None:
        self.daemon = self.sb.popen(sys.executable, "-m", "envctl", "daemon",
                                    env={"ENVCTL_SOCKET": self.socket, **(env or {})})
        deadline = time.monotonic() + 30
        while not self.answers():
            assert self.daemon.poll() is None, f"daemon died: {stderr_of(self.daemon)}"
            assert time.monotonic() < deadline, f"no socket: {stderr_of(self.daemon)}"
            time.sleep(0.02)

    def answers(self) -> bool:
        """Whether a daemon accepts on the socket (a stale file left by a killed one does
        not)."""
        import socket

        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def kill(self, sig: int = signal.SIGTERM) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(sig)
            self.daemon.wait(30)
        self.daemon = None

    def as_user(self, uid: int, *args: str, socket: str | None = None, timeout: float = 60,
                input_: str | None = None):
        return self.sb.run(*self.argv(uid, *args),
                           env={"ENVCTL_SOCKET": socket or self.socket, "HOME": "/"},
                           timeout=timeout, input=input_)

    def as_user_popen(self, uid: int, *args: str):
        return self.sb.popen(*self.argv(uid, *args),
                             env={"ENVCTL_SOCKET": self.socket, "HOME": "/"})

    def argv(self, uid: int, *args: str) -> list[str]:
        groups = {ALICE: f"{ALICE},{TEAM}", BOB: str(BOB)}.get(uid, str(uid))
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={groups}", "--",
                sys.executable, "-m", "envctl", *args]

    def children(self) -> list[int]:
        """The daemon's request children now."""
        pid = self.daemon.pid
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]

    def script(self, uid: int, name: str, text: str) -> str:
        d = self.shared / str(uid)
        d.mkdir(exist_ok=True)
        os.chown(d, uid, uid)
        p = d / name
        p.write_text(text)
        os.chown(p, uid, uid)
        p.chmod(0o755)
        return str(p)


@pytest.fixture
def team(sandbox):
    shared = Path(tempfile.mkdtemp(prefix="envctl-daemon-", dir="/tmp"))
    shared.chmod(0o755)
    passwd, group = shared / "passwd", shared / "group"
    passwd.write_text(Path("/etc/passwd").read_text()
                      + f"alice:x:{ALICE}:{ALICE}::/:/bin/sh\nbob:x:{BOB}:{BOB}::/:/bin/sh\n"
                      f"carol:x:{CAROL}:{CAROL}::/:/bin/sh\n")
    group.write_text(Path("/etc/group").read_text()
                     + f"alice:x:{ALICE}:\nbob:x:{BOB}:\ncarol:x:{CAROL}:\n"
                     f"team-a:x:{TEAM}:alice\n")
    (shared / "pyenv").mkdir()
    # The users run the test's Python, which lives under root's 0700 home: here only, a 0755
    # /root holding just that tree.
    python_home = "/root/.pyenv"
    script = [f"mount --bind {passwd} /etc/passwd", f"mount --bind {group} /etc/group"]
    if os.path.realpath(sys.executable).startswith(python_home + "/"):
        script += [f"mount --bind {python_home} {shared}/pyenv",
                   "mount -t tmpfs -o mode=0755 envctl-test-root /root",
                   f"mkdir {python_home}", f"mount --bind {shared}/pyenv {python_home}"]
    res = sandbox.run("sh", "-c", " && ".join(script))
    assert res.returncode == 0, res.stderr
    sandbox.write_spec("box", SPEC)
    res = sandbox.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    t = Team(sandbox, shared)
    t.start()
    yield t
    t.kill()
    sandbox.envctl("down", "box", "--force")
    sandbox.close()  # its mounts go with its namespace, before the tree they show is removed
    shutil.rmtree(shared, ignore_errors=True)


def _job(res) -> dict:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_listed_user_submits_without_sudo_and_others_are_refused(team):
    prog = team.script(ALICE, "whoami.py", "import os\nprint(os.getuid(), os.getgid())\n")
    job = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    assert job["uid"] == ALICE and job["submitter"][0] == ALICE
    res = team.as_user(ALICE, "wait", str(job["id"]))
    assert res.returncode == 0, res.stderr
    res = team.as_user(ALICE, "logs", str(job["id"]))
    assert res.returncode == 0 and res.stdout.split() == [str(ALICE), str(ALICE)], res.stderr

    # bob is not in access.submit: refused, one line, exit 1, nothing submitted.
    before = sorted(os.listdir(team.sb.state / "jobs"))
    bprog = team.script(BOB, "b.py", "print('bob')\n")
    res = team.as_user(BOB, "submit-job", "box", bprog)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "bob is not in access.submit of box" \
        in res.stderr
    assert sorted(os.listdir(team.sb.state / "jobs")) == before
    # nor may bob touch alice's job.
    for cmd in (["cancel"], ["logs"], ["wait"]):
        res = team.as_user(BOB, *cmd, str(job["id"]))
        assert res.returncode == 1 and "bob may not" in res.stderr, (cmd, res.stderr)
    # bob sees alice's job in `jobs` as squeue shows it: not its argv, program or outputs.
    res = team.as_user(BOB, "jobs", "--all", "--json")
    assert res.returncode == 0, res.stderr
    seen = {j["id"]: j for j in json.loads(res.stdout)}
    other = seen[job["id"]]
    assert other["user"] == "alice" and other["state"] == "COMPLETED"
    assert (other["argv"], other["stdout"], other["program"]) == ([], "", {})
    # Nor its accounting (the owner's, as its outputs are); its times and elapsed are public.
    assert (other["cpu_user_seconds"], other["peak_memory_bytes"]) == (None, None)
    assert other["elapsed"] is not None
    # The table through the daemon (its rows of cells, not records): the same rule, the
    # private cells '-' for bob, shown to alice; the same table root prints in-process.
    cols = "id,user,state,program,maxrss,cpu_user"
    rows = {}
    for who in (ALICE, BOB):
        res = team.as_user(who, "jobs", "--all", "--format", cols)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0].split() == ["ID", "USER", "STATE", "PROGRAM", "MAXRSS", "USERCPU"]
        rows[who] = {ln.split()[0]: ln.split() for ln in lines[1:]}
    theirs, mine = rows[BOB][str(job["id"])], rows[ALICE][str(job["id"])]
    assert theirs == [str(job["id"]), "alice", "COMPLETED", "-", "-", "-"], theirs
    assert mine[:3] == theirs[:3] and mine[3].startswith("staged:") and mine[4] != "-", mine
    res = team.sb.envctl("jobs", "--all", "--format", cols)  # root, in-process
    assert res.returncode == 0, res.stderr
    assert res.stdout == team.as_user(ALICE, "jobs", "--all", "--format", cols).stdout

    # --user root from a non-admin: refused.
    res = team.as_user(ALICE, "submit-job", "--user", "root", "box", prog)
    assert res.returncode == 1 and "may not run a job as root" in res.stderr, res.stderr


def test_a_symlink_to_shadow_is_never_copied(team):
    d = team.shared / str(ALICE)
    d.mkdir(exist_ok=True)
    os.chown(d, ALICE, ALICE)
    link = d / "evil.py"
    link.symlink_to("/etc/shadow")
    os.lchown(link, ALICE, ALICE)
    res = team.as_user(ALICE, "submit-job", "box", str(link))
    assert res.returncode == 2 and "Permission denied" in res.stderr, res.stderr
    # Refused by alice's own open, before the daemon was asked: no job, nothing copied.
    jobs = team.sb.state / "jobs"
    assert not jobs.exists() or not [n for n in os.listdir(jobs) if n[:1].isdigit()]


def test_jobs_outlive_a_killed_daemon_and_a_new_one_serves_them(team):
    # The job cannot see the host's files: it runs long enough for the daemon to die and
    # come back (the wait below is for its end, not a sleep of the test's).
    prog = team.script(ALICE, "slow.py", "import time\ntime.sleep(3)\nprint('done')\n")
    job = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    team.kill(signal.SIGKILL)
    res = team.as_user(ALICE, "jobs", "--json")  # nobody answers: the one line, exit 1
    assert res.returncode == 1 and "daemon is not running" in res.stderr, res.stderr
    record = json.loads((team.sb.state / "jobs" / f"{job['id']}.json").read_text())
    assert record["state"] == "RUNNING"
    team.start()  # replaces the stale socket
    res = team.as_user(ALICE, "wait", "--json", str(job["id"]))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)[0]["state"] == "COMPLETED"
    assert team.as_user(ALICE, "logs", str(job["id"])).stdout == "done\n"


def test_cancel_through_the_daemon_and_no_daemon_for_a_plain_user(team):
    prog = team.script(ALICE, "forever.py", "import time\ntime.sleep(3600)\n")
    job = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    res = team.as_user(ALICE, "cancel", "--grace", "1", str(job["id"]))
    assert res.returncode == 0 and "CANCELLED" in res.stdout, res.stderr
    res = team.as_user(ALICE, "jobs", socket=str(team.shared / "none.sock"))
    assert res.returncode == 1
    assert res.stderr.strip() == (
        f"error: the envctl daemon is not running (no socket at "
        f"{team.shared / 'none.sock'}): start it with 'systemctl start "
        "envctl-daemon.socket' (or run 'envctl daemon' as root)")


def _job_ids(team) -> list[str]:
    jobs = team.sb.state / "jobs"
    return sorted(n for n in os.listdir(jobs) if n[:1].isdigit()) if jobs.exists() else []


def _wait_for(cond, what: str, proc=None, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert proc is None or proc.poll() is None, f"{what}: died: {stderr_of(proc)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return got


def test_jobs_of_an_unknown_environment_is_exit_2_through_the_daemon(team):
    res = team.as_user(ALICE, "jobs", "nosuch")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().startswith("error: no environment 'nosuch': not in the config "
                                         "directory and not up on this host"), res.stderr
    res = team.as_user(ALICE, "jobs", "box")  # known, no job yet: an empty table
    assert res.returncode == 0, res.stderr


def test_a_daemon_refuses_a_socket_directory_others_can_write(team):
    bad = team.shared / "open"
    bad.mkdir()
    bad.chmod(0o777)
    res = team.sb.envctl("daemon", env={"ENVCTL_SOCKET": str(bad / "envctl.sock")},
                         timeout=30)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"error: envctl daemon: the socket's directory {bad} is writable by others (mode "
        "0777): refusing to serve (make it root's, mode 0755, or set ENVCTL_SOCKET)")
    assert os.listdir(bad) == []
    bad.chmod(0o755)
    os.chown(bad, ALICE, ALICE)
    res = team.sb.envctl("daemon", env={"ENVCTL_SOCKET": str(bad / "envctl.sock")},
                         timeout=30)
    assert res.returncode == 1 and f"{bad} is owned by uid {ALICE}, not root" in res.stderr


def test_a_kill_9_of_the_daemon_mid_submit_loses_nothing(team):
    """The submit's child is not the daemon: it finishes, records and answers."""
    flag = team.shared / "go"
    team.kill()
    team.start({"ENVCTL_FAULT": f"until={flag}@submit:before"})
    prog = team.script(ALICE, "hi.py", "print('hi')\n")
    client = team.as_user_popen(ALICE, "submit-job", "--json", "box", prog)
    # The submit's child is held at the fault (the daemon's other children, its queue
    # passes, come and go: counting children would be luck).
    _wait_for(lambda: Path(f"{flag}.waiting").exists(), "the submit's child", client)
    team.kill(signal.SIGKILL)  # in the middle of the submit: nothing written yet
    assert client.poll() is None and _job_ids(team) == []
    flag.touch()
    out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err
    job = json.loads(out)
    assert _job_ids(team) == [str(job["id"]), f"{job['id']}.json"]  # its dir and record
    team.start()
    res = team.as_user(ALICE, "wait", "--json", str(job["id"]))
    assert res.returncode == 0 and json.loads(res.stdout)[0]["state"] == "COMPLETED", \
        res.stderr
    assert team.as_user(ALICE, "logs", str(job["id"])).stdout == "hi\n"


def test_a_submit_killed_in_flight_either_happened_or_left_nothing(team):
    prog = team.script(ALICE, "hi.py", "print('hi')\n")
    team.kill()
    # Killed before anything is written: the client gets an error, no record, no job dir.
    team.start({"ENVCTL_FAULT": "kill@submit:before"})
    res = team.as_user(ALICE, "submit-job", "box", prog)
    assert res.returncode == 1 and "closed the connection during 'submit'" in res.stderr, \
        res.stderr
    assert _job_ids(team) == []
    team.kill()
    # Killed after the record, before the answer: an error, and the job exists and runs.
    team.start({"ENVCTL_FAULT": "kill@submit:after"})
    res = team.as_user(ALICE, "submit-job", "box", prog)
    assert res.returncode == 1 and "closed the connection during 'submit'" in res.stderr, \
        res.stderr
    (jid,) = [n for n in _job_ids(team) if not n.endswith(".json")]
    assert _job_ids(team) == [jid, f"{jid}.json"]
    team.kill()
    team.start()
    res = team.as_user(ALICE, "wait", "--json", jid)
    assert res.returncode == 0 and json.loads(res.stdout)[0]["state"] == "COMPLETED", \
        res.stderr


def test_a_plain_submit_is_answered_once_the_supervisor_holds_the_job(team):
    """The plain submit-job (it prints the id alone) is answered once the job's supervisor has
    written its record, not after the launch: held just before it writes RUNNING, the client
    already has its id and the record is PENDING with the supervisor in it; let go, the job
    runs to COMPLETED. A launch that fails is then exit 0 (the id was printed) with the record
    FAILED and why; --json still waits for the start and says it, exit 1."""
    flag = team.shared / "go"
    team.kill()
    team.start({"ENVCTL_FAULT": f"until={flag}@record:RUNNING"})
    prog = team.script(ALICE, "hi.py", "print('hi')\n")
    try:
        # (Before the early answer, this waited for the flag: a timeout here.)
        res = team.as_user(ALICE, "submit-job", "box", prog, timeout=30)
        assert res.returncode == 0, res.stderr
        jid = int(res.stdout)
        _wait_for(lambda: Path(f"{flag}.waiting").exists(), "the supervisor at RUNNING")
        record = json.loads((team.sb.state / "jobs" / f"{jid}.json").read_text())
        assert record["state"] == "PENDING" and record["start_time"] is None, record
        assert record["supervisor"]["pid"] > 0, record
    finally:
        flag.touch()
    res = team.as_user(ALICE, "wait", "--json", str(jid))
    assert res.returncode == 0 and json.loads(res.stdout)[0]["state"] == "COMPLETED", \
        res.stderr
    assert team.as_user(ALICE, "logs", str(jid)).stdout == "hi\n"
    team.kill()
    team.start()
    # Executable, but no program the kernel can run: the launch fails after the answer.
    bad = team.script(ALICE, "not-a-program", "\x7fELF\x02\x01\x01" + "\0" * 57)
    res = team.as_user(ALICE, "submit-job", "box", bad)
    assert res.returncode == 0, res.stderr
    res = team.as_user(ALICE, "wait", "--json", res.stdout.strip())
    done = json.loads(res.stdout)[0]
    assert res.returncode == 126 and (done["state"], done["start_time"]) == ("FAILED", None)
    assert "cannot run it" in done["error"], done
    res = team.as_user(ALICE, "submit-job", "--json", "box", bad)
    assert res.returncode == 1 and "did not start" in res.stderr, res.stderr
    assert json.loads(res.stdout)["state"] == "FAILED"


def test_pending_waits_do_not_hold_a_users_submit(team):
    from envctl.server import server

    prog = team.script(ALICE, "forever.py", "import time\ntime.sleep(3600)\n")
    job = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    waits = [team.as_user_popen(ALICE, "wait", str(job["id"]))
             for _ in range(server.MAX_CHILDREN_PER_UID)]
    try:
        _wait_for(lambda: len(team.children()) >= len(waits), "the waits' children")
        quick = team.script(ALICE, "q.py", "print('q')\n")
        res = team.as_user(ALICE, "submit-job", "--json", "box", quick, timeout=30)
        assert res.returncode == 0, res.stderr
    finally:
        res = team.as_user(ALICE, "cancel", "--grace", "1", str(job["id"]))
        for w in waits:
            w.communicate(timeout=60)
    assert res.returncode == 0, res.stderr
    assert all(w.returncode != 0 for w in waits)  # CANCELLED: wait's exit is not 0


def test_exec_through_the_daemon_runs_as_the_caller_with_its_stdio(team):
    res = team.as_user(ALICE, "exec", "box", "--", "python3", "-c",
                       "import os, sys; print(os.getuid(), os.getgid()); "
                       "print(sys.stdin.read().upper(), file=sys.stderr); sys.exit(3)",
                       input_="piped in")
    assert res.returncode == 3, res.stderr
    assert res.stdout.split() == [str(ALICE), str(ALICE)]
    assert res.stderr.strip() == "PIPED IN"
    # bob is not in access.submit; alice may not ask for root.
    res = team.as_user(BOB, "exec", "box", "--", "true")
    assert res.returncode == 1 and res.stderr.count("\n") == 1 and \
        "bob is not in access.submit of box" in res.stderr, res.stderr
    res = team.as_user(ALICE, "exec", "--user", "root", "box", "--", "true")
    assert res.returncode == 1 and "may not run a job as root" in res.stderr, res.stderr
    res = team.as_user(ALICE, "exec", "box", "--", "no-such-command")
    assert res.returncode == 127, res.stderr


def test_ctrl_c_of_an_exec_through_the_daemon_reaches_the_command(team):
    client = team.as_user_popen(
        ALICE, "exec", "box", "--", "python3", "-c",
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: (print('got INT', flush=True), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    assert client.stdout.readline() == "ready\n", stderr_of(client)
    client.send_signal(signal.SIGINT)
    out, err = client.communicate(timeout=30)
    assert client.returncode == 7, err
    assert out == "got INT\n"
    # Closing the connection (the client killed) kills the command.
    client = team.as_user_popen(ALICE, "exec", "box", "--", "python3", "-c",
                                "import time; print('ready', flush=True); time.sleep(600)")
    assert client.stdout.readline() == "ready\n", stderr_of(client)
    _wait_for(team.children, "the exec's child")
    client.kill()
    client.communicate(timeout=30)
    _wait_for(lambda: not team.children(), "the exec's child to end")


def test_an_operator_brings_an_environment_down_and_up_without_sudo(team):
    def state() -> str:
        res = team.as_user(CAROL, "status", "box", "--json")
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)[0]["state"]

    assert state() == "up"
    res = team.as_user(CAROL, "down", "box", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "box" in res.stdout  # the command's own output, on carol's stdout
    assert state() == "down" and not (team.sb.state / "journal" / "box.json").exists()
    res = team.as_user(CAROL, "up", "box", timeout=120)
    assert res.returncode == 0, res.stderr
    assert state() == "up"
    # A submit-only user: one line, exit 1, nothing changed.
    res = team.as_user(ALICE, "down", "box")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "alice is not in access.operate of box (users: carol" in res.stderr, res.stderr
    assert state() == "up"
    # All environments: admins only; and nothing that picks other specs or settings.
    res = team.as_user(CAROL, "down", "--all")
    assert res.returncode == 2 and "--all" in res.stderr, res.stderr
    res = team.as_user(CAROL, "-C", "/tmp", "down", "box")
    assert res.returncode == 2 and "-C is not taken through the daemon" in res.stderr, \
        res.stderr
    assert state() == "up"
