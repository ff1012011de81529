"""An attacker's review of session 33's new code, the second one: what a host user (`nobody`)
can do to root's `up`, `down`, `maintenance --gpus`, the queue's claims and the daemon's
listings. Each test makes one attempt on the real kernel, in the sandbox.

`ATTACK (fixed)`: the test failed on the code before the commit that adds it with its fix;
`ATTACK (open)`: xfail(strict=True), the fix still to make (its reason says what it is); the
others record attempts that held.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

from tests.integration.sandbox import stderr_of
from tests.integration.test_attacks_daemon import RAW, alive, raw
from tests.integration.test_daemon import BOB, team  # noqa: F401 (a fixture)

pytestmark = pytest.mark.root

NOBODY = 65534

# Run as nobody, in the directory it was started in: hold an flock of that directory (which
# it may open: /run/envctl is 0755) until killed.
HOLD_FLOCK = """
import fcntl, os, sys, time
fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(3600)
"""


def as_nobody(code: str, cwd) -> subprocess.Popen:
    """`code` run by Python as nobody (no groups), started in `cwd` (the chdir is made before
    the user changes, as a user whose shell is already there)."""
    return subprocess.Popen([sys.executable, "-I", "-c", code], cwd=cwd, user=NOBODY,
                            group=NOBODY, extra_groups=[], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_user_holding_an_flock_of_the_run_directory_does_not_hang_up_or_down(clean):
    """ATTACK (fixed): not-up.json's read-modify-write (retry.record_attempt, after every
    `up` and `down`) took a blocking flock of the run directory itself. /run/envctl is 0755
    (plain users reach the daemon's socket through it): any user may open it read-only and
    flock it, so `nobody` held it and root's `up` and `down` blocked for ever, once their
    work was done, in flock(2)."""
    sb = clean
    sb.write_spec("ok", "name: ok\nkind: cpu\n")
    sb.run_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    sb.run_dir.chmod(0o755)
    holder = as_nobody(HOLD_FLOCK, sb.run_dir)
    try:
        assert holder.stdout.readline().strip() == "held", stderr_of(holder)
        try:
            up = sb.envctl("up", "ok", timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("root's `up` blocked behind nobody's flock of the run directory")
        assert up.returncode == 0, up.stderr
        try:
            down = sb.envctl("down", "ok", timeout=60)
        except subprocess.TimeoutExpired:
            sb.envctl("down", "ok", "--force", timeout=5)
            pytest.fail("root's `down` blocked behind nobody's flock of the run directory")
        assert down.returncode == 0, down.stderr
        assert holder.poll() is None, stderr_of(holder)
    finally:
        holder.kill()
        holder.wait()
        time.sleep(0)


def test_a_jobs_listing_of_an_environment_named_by_a_path_does_not_block_the_daemon(
        team):  # noqa: F811
    """ATTACK (fixed): `envctl jobs ENV` is answered in the daemon's own loop
    (handlers.list_jobs, inline), which read `<state>/jobs/.queue/ENV` as root with ENV as
    the request gave it: a name was never checked, and `.queue / "/tmp/x/fifo"` is
    `/tmp/x/fifo`. bob (in no access list) named a FIFO of his: the daemon's loop blocked in
    open() for ever, serving nobody (`/dev/zero`: it read until memory ran out; a file of
    JSON lines of his: shown as queued jobs, parsed and kept in the daemon's memory)."""
    t = team
    # A queue has existed (any job that ever waited leaves the directory).
    (t.sb.state / "jobs" / ".queue").mkdir(mode=0o700, parents=True, exist_ok=True)
    mine = t.shared / "bob"
    mine.mkdir()
    os.chown(mine, BOB, BOB)
    fifo = mine / "fifo"
    os.mkfifo(fifo)
    os.chown(fifo, BOB, BOB)
    code = ("s = conn(); s.sendall(frame({'v': 1, 'op': 'jobs', 'env': %r,"
            " 'fields': ['id']}))\n"
            "s.settimeout(20)\n"
            "try:\n"
            "    print(json.dumps(reply(s)))\n"
            "except TimeoutError:\n"
            "    print(json.dumps({'blocked': True}))\n")
    for env in (str(fifo), f"../../../../../../../../../..{fifo}"):
        res = t.sb.run("setpriv", f"--reuid={BOB}", f"--regid={BOB}", f"--groups={BOB}", "--",
                       sys.executable, "-c", RAW + code % env,
                       env={"ENVCTL_SOCKET": t.socket, "HOME": "/"}, timeout=60)
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout.strip().splitlines()[-1])
        assert not got.get("blocked"), "the daemon's loop blocked opening bob's FIFO"
        assert not got["ok"] and got.get("exit") == 2, got
        assert "environment" in got["error"], got
    alive(t)


RELINGER = r"""
import struct
# A TCP connection on loopback whose peer never reads (never even accepted), its send buffer
# full: whoever makes the last close of it with SO_LINGER set waits in close(2) for ever.
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
c = socket.socket()
c.connect(srv.getsockname())
c.setblocking(False)
try:
    while True:
        c.send(b"x" * 65536)
except BlockingIOError:
    pass
FOREVER = struct.pack("ii", 1, 2**31 - 1)
c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, FOREVER)
s = conn()
# The frame's first bytes only, with the socket: the daemon keeps it while it waits for the
# rest. It clears SO_LINGER as it receives it (the fix of the first review), which shows here.
body = frame({"v": 1, "op": "ping"})
socket.send_fds(s, [body[:6]], [c.fileno()])
deadline = time.monotonic() + 20
while struct.unpack("ii", c.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))[0]:
    assert time.monotonic() < deadline, "the daemon never received it"
    time.sleep(0.01)
# Set again by bob's own copy (the same socket), which he then closes, and he leaves: the
# daemon drops the half request and closes its copy, the last one.
c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, FOREVER)
c.close()
s.close()
print(json.dumps({"left": True}), flush=True)
time.sleep(float(sys.argv[1]))  # the peer lives on (keeps acknowledging window probes)
"""


def test_a_socket_lingering_again_after_the_daemon_received_it_does_not_block_its_loop(
        team):  # noqa: F811
    """ATTACK (fixed): the first review's fix clears SO_LINGER of a socket the daemon
    receives, but the option belongs to the socket, which bob still holds: he sets it again
    through his own
    copy once the daemon has cleared it (he sees it cleared through that copy), closes his
    copy, and leaves with his request half sent. The daemon's loop drops the connection and
    closes the descriptors it brought: the last close, with SO_LINGER "for ever", of a TCP
    socket whose peer never reads. The loop waits in close(2), serving nobody."""
    proc = team.sb.popen("setpriv", f"--reuid={BOB}", f"--regid={BOB}", f"--groups={BOB}",
                         "--", sys.executable, "-c", RAW + RELINGER, "60",
                         env={"ENVCTL_SOCKET": team.socket, "HOME": "/"})
    try:
        line = proc.stdout.readline()
        assert line, stderr_of(proc)
        got = raw(team, 0, r"""
s = conn()
s.sendall(frame({"v": 1, "op": "ping"}))
s.settimeout(10)
try:
    print(json.dumps({"answered": bool(s.recv(65536))}))
except socket.timeout:
    print(json.dumps({"answered": False}))
""")
        assert got["answered"], "the daemon's loop hangs in close(2) of bob's socket"
    finally:
        proc.kill()
        proc.wait()
    alive(team)


# Run in the sandbox (root, its mount namespace): a FUSE file system mounted for bob on his
# directory `argv[1]` (what fusermount3 does for him on a host with fuse3) whose server never
# answers anything, not even INIT: every look inside waits for it.
FUSE_NEVER = r"""
import ctypes, os, sys, time
where = sys.argv[1]
fd = os.open("/dev/fuse", os.O_RDWR)
libc = ctypes.CDLL(None, use_errno=True)
opts = f"fd={fd},rootmode=40000,user_id={sys.argv[2]},group_id={sys.argv[2]},allow_other"
if libc.mount(b"bob-fuse", where.encode(), b"fuse", 0, opts.encode()) != 0:
    raise OSError(ctypes.get_errno(), "mount fuse")
print("mounted", flush=True)
time.sleep(3600)  # holding /dev/fuse, answering nothing; killed: the connection aborts
"""


def test_a_fuse_mount_where_an_operators_spec_link_leads_does_not_block_the_daemon(
        team):  # noqa: F811
    """ATTACK (fixed): the first review closed the FIFO swapped in where an operator's spec
    link leads (a directory bob owns): the daemon opens specs O_NONBLOCK. bob mounts a FUSE
    file system there instead (fusermount3 lets a user mount on a directory he owns) whose
    server never answers: the daemon's own loop, looking up the environment a request names
    (any request: warm), waited in open() for ever, serving nobody. Now a spec link is
    walked a component at a time, and one that reaches a user's FUSE mount is not opened."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this host (the fuse module not loaded)")
    t = team
    home = t.shared / "bob-home"
    home.mkdir()
    os.chown(home, BOB, BOB)
    (t.sb.config_dir / "bobs.yaml").symlink_to(home / "spec.yaml")  # the operator's link
    holder = t.sb.popen(sys.executable, "-c", FUSE_NEVER, str(home), str(BOB))
    try:
        assert holder.stdout.readline().strip() == "mounted", stderr_of(holder)
        code = ("s = conn(); s.sendall(frame({'v': 1, 'op': 'submit', 'env': 'box',"
                " 'exe': '/bin/true'}))\n"
                "s.settimeout(15)\n"
                "try:\n"
                "    print(json.dumps({'answered': bool(s.recv(65536))}))\n"
                "except TimeoutError:\n"
                "    print(json.dumps({'answered': False}))\n")
        got = raw(t, BOB, code)
        assert got["answered"], "the daemon's loop waits on bob's FUSE file system"
    finally:
        holder.kill()
        holder.wait()
        with contextlib.suppress(OSError):
            (t.sb.config_dir / "bobs.yaml").unlink()
    alive(t)
