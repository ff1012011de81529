"""An attacker's review of the daemon (issue #22) and of what a host user, root inside a
partition, or a user who controls a job's paths can do through it (issue #20). Each test makes
one attempt on the real kernel, inside the sandbox's own mount namespace with real users made
for the test (tests/integration/test_daemon.py's `team`), and asserts what must hold.

A test marked `ATTACK (fixed)` reproduces what this review found (it failed on the daemon as
it first landed; the commit that fixed it says how); the others record attempts the daemon
stopped from the start and that stay real threats.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from envctl.server import server
from tests.integration.sandbox import stderr_of
from tests.integration.test_daemon import ALICE, BOB, _job, team  # noqa: F401 (a fixture)

pytestmark = pytest.mark.root


# A raw client: the test's Python run as `uid` (setpriv), talking to the socket byte by byte as
# an attacker would, not through envctl's client.
RAW = r"""
import json, os, socket, struct, sys, time
path = os.environ["ENVCTL_SOCKET"]
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s
def frame(obj):
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body
def reply(s):
    s.settimeout(30)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return json.loads(data[4:]) if len(data) >= 4 else None
"""


def raw(t, uid: int, code: str, *, timeout: float = 60):
    """Run `code` (after RAW's helpers) as `uid`; its stdout's last line as JSON."""
    res = t.sb.run("setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={uid}", "--",
                      sys.executable, "-c", RAW + code,
                      env={"ENVCTL_SOCKET": t.socket, "HOME": "/"}, timeout=timeout)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def alive(t) -> None:
    """The daemon still runs and still answers (a ping) as bob, who is in no access list."""
    assert t.daemon.poll() is None, t.daemon.stderr
    got = raw(t, BOB, 's = conn(); s.sendall(frame({"v": 1, "op": "ping"}))\n'
                         'print(json.dumps(reply(s)))')
    assert got["ok"] and got["uid"] == BOB, got


def test_a_request_whose_op_is_not_a_string_does_not_kill_the_daemon(team):  # noqa: F811
    """ATTACK (fixed): `{"v": 1, "op": []}` from any host user (bob is in no access list)
    raised TypeError (an unhashable key) in the daemon's own loop, and the daemon exited:
    nobody was served until root restarted it. Now: exit 2, one line, the daemon serves on."""
    for op in ([], {}, [["x"]], 1.5, None, True):
        request = json.dumps({"v": 1, "op": op})
        got = raw(team, BOB, f"s = conn(); s.sendall(frame(json.loads({request!r})))\n"
                             "print(json.dumps(reply(s)))")
        assert got is not None and got["ok"] is False and got["exit"] == 2, (op, got)
        alive(team)


def test_a_deeply_nested_request_is_bad_input_and_the_daemon_serves_on(team):  # noqa: F811
    """ATTACK (fixed): a 64 KiB request nesting 30,000 lists raised RecursionError in the
    JSON decoder (not a ValueError: not caught as bad input), in the daemon's own loop. Now
    it is exit 2, one line; the daemon serves on."""
    got = raw(team, BOB, 'body = b\'{"v":1,"op":"ping","x":\' + b"[" * 30000 + b"]" * 30000'
                         ' + b"}"\ns = conn(); s.sendall(struct.pack(">I", len(body)) + body)\n'
                         "print(json.dumps(reply(s)))")
    assert got is not None and got["ok"] is False and got["exit"] == 2, got
    assert "JSON" in got["error"], got
    alive(team)


def test_a_job_name_cannot_write_to_another_users_terminal(team):  # noqa: F811
    """ATTACK (fixed): the `envctl jobs` table printed a job's name, program and arguments as
    they were sent; alice's job named with an escape sequence (OSC 52 writes the viewer's
    clipboard; CSI 2J clears the screen to draw a forged table) or a newline (a forged row:
    another user's job shown RUNNING) reached root's terminal and bob's as it is. Every cell
    is printed with its control characters escaped."""
    prog = team.script(ALICE, "t.py", "print('x')\n")
    evil = "\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2J\nforged  box  root  RUNNING"
    res = team.as_user(ALICE, "submit-job", "--json", "--name", evil, "box", prog, "\x1b[31m")
    job = _job(res)
    assert job["name"] == evil  # kept as given: the record is data, not a terminal
    assert team.as_user(ALICE, "wait", str(job["id"])).returncode == 0
    for who in (ALICE, BOB):
        res = team.as_user(who, "jobs", "--all")
        assert res.returncode == 0, res.stderr
        assert "\x1b" not in res.stdout and "\x07" not in res.stdout, repr(res.stdout)
        assert len(res.stdout.splitlines()) == 2, res.stdout  # the header and the one job
    res = team.sb.envctl("jobs", "--all")  # root, in-process
    assert res.returncode == 0 and "\x1b" not in res.stdout, repr(res.stdout)
    assert len(res.stdout.splitlines()) == 2, res.stdout


GiB = 1 << 30


def test_a_sparse_program_cannot_fill_the_state_disk(team):  # noqa: F811
    """ATTACK (fixed): a program is copied into `<state>/jobs/<id>/` by root, byte for byte.
    alice's `truncate -s 100G x.py` costs her no disk, and the copy wrote every hole as zeros
    to root's state disk (root's reserved blocks too), as many as she liked (and a file she
    keeps extending while it is copied, without end). A program over MAX_PROGRAM (1 GiB) is
    refused, exit 2, and nothing of it is left."""
    from envctl.runtime.supervisor import MAX_PROGRAM

    assert GiB == MAX_PROGRAM
    prog = team.script(ALICE, "huge.py", "print('hi')\n")
    os.truncate(prog, GiB + 1)
    res = team.as_user(ALICE, "submit-job", "--json", "box", prog, timeout=120)
    assert res.returncode == 2 and "1 GiB" in res.stderr, (res.returncode, res.stderr)
    assert res.stderr.strip().count("\n") == 0, res.stderr
    jobs = team.sb.state / "jobs"
    assert not jobs.exists() or not [n for n in os.listdir(jobs) if n[:1].isdigit()]


def test_a_spec_linked_from_a_directory_a_user_owns_grants_nothing(team):  # noqa: F811
    """ATTACK (fixed): the spec that holds `access:` checked for owners other than root along
    the path as written (the config directory and the link in it), not along the path the
    link leads to. An operator's `ln -s /home/ops/specs/box.yaml /etc/envctl/`, the file
    root's, its directory ops's: ops swaps it between the daemon's check and its read (or
    for any root-owned file of his choosing) and lists himself. Now every directory the link
    leads through must be root's too, or the environment is its admins' alone."""
    ops = team.shared / "ops"
    ops.mkdir()
    os.chown(ops, BOB, BOB)
    target = ops / "box.yaml"
    link = team.sb.config_dir / "box.yaml"
    target.write_text(link.read_text().replace("users: [alice]", "users: [alice, bob]"))
    target.chmod(0o644)  # root's, 0644: only its directory is bob's
    link.unlink()
    link.symlink_to(target)
    prog = team.script(BOB, "b.py", "print('bob')\n")
    res = team.as_user(BOB, "submit-job", "--json", "box", prog)
    assert res.returncode == 1, res.stdout
    assert "not root's alone" in res.stderr and str(ops) in res.stderr, res.stderr


def test_one_user_holding_every_slot_it_may_leaves_others_served(team):  # noqa: F811
    """Resource exhaustion by one user: alice holds 16 `wait`s of her own long job (every child
    a uid may have) and queues more, up to the 32 connections a uid may have; one more is
    refused at once (busy, exit 1), and meanwhile bob's ping and root's `cancel` through the
    daemon (a forked request) are served. (Colluding users could fill the daemon's global
    caps; root's requests are never queued behind them: Daemon.start_queued.)"""
    prog = team.script(ALICE, "forever.py", "import time\ntime.sleep(3600)\n")
    job = _job(team.as_user(ALICE, "submit-job", "--json", "box", prog))
    hog = team.sb.popen("setpriv", f"--reuid={ALICE}", f"--regid={ALICE}",
                        f"--groups={ALICE}", "--", sys.executable, "-c", RAW + f"""
import select
held, refused = [], {{}}
for i in range(100):
    s = conn()
    try:  # the daemon may refuse and close before the request is read
        s.sendall(frame({{"v": 1, "op": "wait", "ids": [{job['id']}]}}))
    except (BrokenPipeError, ConnectionResetError):
        pass
    held.append(s)
    # A held wait says nothing; a refusal comes at once, or late on a loaded machine: so
    # every socket is looked at, and the first refused one counts.
    for j, r in enumerate(held):
        if j not in refused and select.select([r], [], [], 0.3 if r is s else 0)[0]:
            refused[j] = r.recv(65536)
    if refused:
        time.sleep(2)  # a late refusal of an earlier one would show now
        for j, r in enumerate(held):
            if j not in refused and select.select([r], [], [], 0)[0]:
                refused[j] = r.recv(65536)
        first = min(refused)
        print(json.dumps([first, json.loads(refused[first][4:])]), flush=True)
        break
time.sleep(600)  # hold them until the test is done
""", env={"ENVCTL_SOCKET": team.socket})
    try:
        line = hog.stdout.readline()
        assert line, stderr_of(hog)
        held, busy = json.loads(line)
        # Every wait child a uid may have, then the connections a uid may have waiting.
        assert held == server.MAX_WAITS_PER_UID + server.MAX_CONNS_PER_UID, held
        assert busy["ok"] is False and busy["exit"] == 1 and "busy" in busy["error"], busy
        alive(team)
        res = team.sb.envctl("cancel", "--grace", "1", str(job["id"]),
                             env={"ENVCTL_SOCKET": team.socket})
        assert res.returncode == 0 and "CANCELLED" in res.stdout, res.stderr
    finally:
        hog.kill()
        hog.wait()


def test_a_jobs_request_naming_bad_or_endless_fields_is_bad_input(team):  # noqa: F811
    """ATTACK (fixed before it shipped): the daemon makes `envctl jobs`' table in its own loop
    from the fields a request names; an unknown one, a non-string, none, or "id" 10,000 times
    (10,000 cells a job, for every job) is exit 2, one line, and the daemon serves on. A valid
    request from bob gets the table, alice's job in it with its private cells '-'."""
    prog = team.script(ALICE, "t.py", "print('x')\n")
    job = json.loads(team.as_user(ALICE, "submit-job", "--json", "box", prog).stdout)
    assert team.as_user(ALICE, "wait", str(job["id"])).returncode == 0
    for fields in (["nosuch"], [1], [], ["id"] * 10_000, "id"):
        request = json.dumps({"v": 1, "op": "jobs", "all": True, "fields": fields})
        got = raw(team, BOB, f"s = conn(); s.sendall(frame(json.loads({request!r})))\n"
                             "print(json.dumps(reply(s)))")
        assert got is not None and got["ok"] is False and got["exit"] == 2, (fields[:2], got)
        assert "\n" not in got["error"], got
        alive(team)
    request = json.dumps({"v": 1, "op": "jobs", "all": True, "fields": ["id", "program"]})
    got = raw(team, BOB, f"s = conn(); s.sendall(frame(json.loads({request!r})))\n"
                         "print(json.dumps(reply(s)))")
    assert got["ok"] and got["rows"] == [["ID", "PROGRAM"], [str(job["id"]), "-"]], got
    res = team.as_user(ALICE, "jobs", "--all", "--format", ",".join(["id"] * 65))
    assert res.returncode == 2 and "at most 64" in res.stderr, res.stderr
