"""An attacker's review, session 33: what a host user who owns a directory envctl's root
processes write to or read from (the monitor's textfile directory, a directory an operator's
spec link leads through), a plain user through the daemon, and root inside a partition can do.
Each test makes one attempt on the real kernel, in the sandbox.

`ATTACK (fixed)`, `ATTACK (closed)`: the test failed on the code before the commit that adds
it or its fix; `ATTACK (open)`: xfail(strict=True), the fix still to make (its reason says
what it is); the others record attempts that held.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.sandbox import stderr_of
from tests.integration.test_attacks_daemon import RAW, alive, raw
from tests.integration.test_daemon import BOB, team  # noqa: F401 (a fixture)

pytestmark = pytest.mark.root

NOBODY = 65534


def wait_until(cond, timeout: float, proc=None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"it died: {stderr_of(proc)}")
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- the monitor's textfile


def test_the_textfile_directorys_owner_cannot_make_the_monitor_overwrite_a_root_file(
        clean, tmp_path):
    """ATTACK (fixed): node_exporter's textfile directory is commonly its service user's
    (`node-exp`, 0775: the prometheus-community role). The monitor, root, wrote each tick to
    `.envctl.prom.<its pid>.tmp` beside the textfile, opened O_CREAT|O_TRUNC by name: that
    user planted the name as a symlink to any root file, and root truncated it and wrote the
    exposition there (host.files.atomic_write, which every root writer of envctl uses)."""
    sb = clean
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    os.chown(textdir, NOBODY, NOBODY)
    victim = tmp_path / "shadow"
    victim.write_text("root:secret\n")
    victim.chmod(0o600)
    prom = textdir / "envctl.prom"
    proc = sb.popen(sys.executable, "-m", "envctl", "monitor", "--interval", "0.2", "--listen",
                    "none", "--csv-dir", "none", "--no-heal", "--textfile", str(prom))
    try:
        assert wait_until(prom.exists, 60, proc), "no first tick"
        # nobody, who owns the directory, plants the monitor's next temporary name.
        link = textdir / f".envctl.prom.{proc.pid}.tmp"
        link.symlink_to(victim)
        os.lchown(link, NOBODY, NOBODY)
        first = os.stat(prom).st_ino
        # Two more ticks: the textfile replaced at least twice after the link was planted.
        seen = {first}
        assert wait_until(lambda: seen.add(os.stat(prom).st_ino) or len(seen) >= 3, 60, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
            proc.wait()
    assert victim.read_text() == "root:secret\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_the_csv_directorys_owner_cannot_make_the_monitor_append_to_a_root_file(clean,
                                                                               tmp_path):
    """ATTACK (fixed): the same with `--csv-dir` in a directory another user owns: the
    monitor opened `cpu-metrics.csv` there by name, following a symlink, and appended its rows
    to whatever root file it named. Now O_NOFOLLOW, a regular file only: a warning, nothing
    written."""
    sb = clean
    csvdir = tmp_path / "csv"
    csvdir.mkdir()
    os.chown(csvdir, NOBODY, NOBODY)
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAA root\n")
    link = csvdir / "cpu-metrics.csv"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    res = sb.envctl("monitor", "--once", "--no-heal", "--csv-dir", str(csvdir))
    assert res.returncode == 0, res.stderr
    assert victim.read_text() == "ssh-ed25519 AAAA root\n"
    assert "CSV not written" in res.stderr, res.stderr


# ---------------------------------------------------------------- a spec linked from a user's
# directory, read by the daemon's own loop


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    if _libc.renameat2(-100, bytes(a), -100, bytes(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_a_spec_swapped_for_a_fifo_cannot_hang_the_daemon(team):  # noqa: F811
    """ATTACK (fixed): before a forked request, the daemon's own loop (handlers.warm) finds
    the request's spec by reading the `name:` line of every spec file of the config directory
    (access._spec_file): stat (is_file), then open by name, blocking. The operator's link to
    a spec in bob's directory (the case test_attacks_daemon's
    test_a_spec_linked_from_a_directory_a_user_owns_grants_nothing refuses to trust) let bob
    flip the file with a FIFO between the two: the daemon's loop blocked in open() forever
    and nobody was served again. Now the file is opened O_NONBLOCK and read only when the
    descriptor is a regular file."""
    ops = team.shared / "ops"
    ops.mkdir()
    os.chown(ops, BOB, BOB)
    spec, fifo = ops / "a.yaml", ops / "flip"
    spec.write_text("name: aaa\nkind: cpu\n")
    os.mkfifo(fifo)
    for p in (spec, fifo):
        os.chown(p, BOB, BOB)
    (team.sb.config_dir / "a.yaml").symlink_to(spec)
    # bob flips his two names as fast as he can (renameat2 RENAME_EXCHANGE: the name is
    # always there, a file or a FIFO).
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            _exchange(spec, fifo)

    racer = threading.Thread(target=flip, daemon=True)
    racer.start()
    try:
        # A forked request (its env names no spec: every file is read) at a time, as bob.
        got = raw(team, BOB, r"""
hung = 0
for i in range(400):
    s = conn()
    s.sendall(frame({"v": 1, "op": "wait", "env": "zzz", "ids": [1]}))
    s.settimeout(5)
    try:
        data = s.recv(65536)
    except socket.timeout:
        hung += 1
        break
    finally:
        s.close()
pinged = None
if hung:  # the loop itself, or only that request's child?
    s = conn()
    s.sendall(frame({"v": 1, "op": "ping"}))
    s.settimeout(5)
    try:
        pinged = bool(s.recv(65536))
    except socket.timeout:
        pinged = False
print(json.dumps({"hung": hung, "tries": i + 1, "ping answered": pinged}))
""", timeout=300)
    finally:
        stop.set()
        racer.join()
        # Whatever it is blocked on gets a writer now (the one FIFO, under either name), so
        # that the fixture can end the daemon.
        for p in (spec, fifo):
            if stat.S_ISFIFO(os.lstat(p).st_mode):
                with contextlib.suppress(OSError):  # ENXIO: nobody reads it
                    os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
    assert got["hung"] == 0, got
    alive(team)


# ---------------------------------------------------------------- the GPU health check


@pytest.fixture
def gpu_host(sandbox, tmp_path):
    import shutil

    if shutil.which("gcc") is None or shutil.which("ldconfig") is None:
        pytest.skip("needs gcc and ldconfig (scripts/install-deps installs them)")
    from tests.integration.test_gpu_env import fake_gpu_host

    return sandbox, fake_gpu_host(tmp_path / "gpuroot")


def test_a_host_user_cannot_quarantine_a_gpu_through_the_kernel_log(gpu_host, clean):
    """ATTACK (fixed): the health check took any kernel log record holding "NVRM: Xid
    (PCI:…): 79" anywhere in its text for the driver's report of a fatal XID. Any host user
    writes such text into the kernel's own records: in a user namespace of its own, a mount
    with a bad option is logged by the kernel with the option quoted ("tmpfs: Unknown
    parameter 'NVRM: Xid (PCI:0000:3b:00): 79'"). The next `up` (or monitor tick)
    quarantined that GPU, out of every environment until an operator cleared it, as often as
    the user liked. Now only a kernel record (facility 0) whose text starts with the driver's
    "NVRM: Xid" counts."""
    from tests.integration.test_gpu_env import UUIDS, gpu_spec
    from tests.integration.test_gpu_health import pci_of

    sb, env = gpu_host
    pci = pci_of(env, 1)
    res = sb.run("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                 "unshare", "-Urm", "mount", "-t", "tmpfs", "-o",
                 f"NVRM: Xid (PCI:{pci}): 79", "none", "/tmp")
    if res.stderr.startswith("unshare:"):
        pytest.skip(f"no user namespace mount for nobody here: {res.stderr.strip()}")
    # The fake driver tree reads the real kernel log.
    kmsg = Path(env["ENVCTL_GPU_ROOT"]) / "dev" / "kmsg"
    kmsg.unlink(missing_ok=True)
    os.mknod(kmsg, stat.S_IFCHR | 0o600, os.makedev(1, 11))
    report = sb.envctl_json("gpus", env=env)
    assert [g["health"] for g in report["gpus"]] == [None, None], report["gpus"]
    sb.write_spec("gpu-a", gpu_spec("gpu-a", "2"))
    res = sb.envctl("up", "gpu-a", env=env)
    try:
        assert res.returncode == 0, res.stderr
        assert "quarantined" not in res.stderr
        assert not (sb.state / "gpu-quarantine.json").exists() or UUIDS[1] not in \
            (sb.state / "gpu-quarantine.json").read_text()
    finally:
        sb.envctl("down", "gpu-a", env=env)



# ---------------------------------------------------------------- descriptors passed to the
# daemon


LINGER = r"""
import struct
# A TCP connection on loopback whose peer never reads (never even accepted): its send
# buffer filled, then SO_LINGER "wait for ever". Whoever closes the last reference to it
# waits in close(2) for the data (and the FIN) to be acknowledged: never.
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
c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 2**31 - 1))
s = conn()
extra = int(sys.argv[2])  # descriptors before it: past the 8 a request may bring, the kernel
null = [os.open("/dev/null", os.O_RDONLY) for _ in range(extra)]  # drops it, in the daemon
socket.send_fds(s, [frame({"v": 1, "op": "ping"})], null + [c.fileno()])
c.close()  # the daemon's copy is the last one now
s.settimeout(10)
try:
    first = bool(s.recv(65536))
except socket.timeout:
    first = False
print(json.dumps({"answered": first}), flush=True)
time.sleep(float(sys.argv[1]))  # the peer lives on (keeps acknowledging window probes)
"""


@pytest.mark.parametrize("extra", [0, 8], ids=["passed", "dropped"])
def test_a_lingering_socket_passed_to_the_daemon_does_not_block_its_loop(team, extra):  # noqa: F811
    """ATTACK (fixed): the daemon's own loop closes the descriptors a request brought (an
    inline request's after its answer, a forked one's once the child has them, any
    request's it refuses). bob passes a TCP socket whose peer never reads, with SO_LINGER
    set to wait for ever, and closes his own copy: the daemon's close(2) is the last, and
    it waits, in its loop, for data that will never be acknowledged. Nobody is served while
    bob's process lives. The same when the socket is the ninth descriptor: the kernel drops
    what does not fit in the daemon's recvmsg, and that last close is the daemon's too."""
    proc = team.sb.popen("setpriv", f"--reuid={BOB}", f"--regid={BOB}", f"--groups={BOB}",
                         "--", sys.executable, "-c", RAW + LINGER, "60", str(extra),
                         env={"ENVCTL_SOCKET": team.socket, "HOME": "/"})
    try:
        line = proc.stdout.readline()
        assert line, stderr_of(proc)
        # While bob's process lives: another user's ping is answered.
        got = raw(team, 0, r"""
s = conn()
s.sendall(frame({"v": 1, "op": "ping"}))
s.settimeout(10)
try:
    print(json.dumps({"answered": bool(s.recv(65536))}))
except socket.timeout:
    print(json.dumps({"answered": False}))
""")
        assert got["answered"], f"the daemon's loop hangs (bob's ping: {line.strip()})"
    finally:
        proc.kill()
        proc.wait()
    alive(team)


def test_exec_never_hands_the_partition_a_host_directory(team):  # noqa: F811
    """ATTACK (closed): `envctl exec` through the daemon gave the command the client's own
    stdin, stdout and stderr, refusing only a terminal. A directory is passed as well (a
    shell's `< DIR` opens it), and inside the partition the command holds a descriptor of
    the host's tree: `cd /proc/self/fd/0` goes there and lists it, out of the mount
    namespace the partition is (the shape of CVE-2024-21626: a host directory descriptor
    reaching a container, where any process that can take it from the command, root inside
    with SYS_PTRACE, a process of the same uid, walks the host's tree with its rights)."""
    marker = team.shared / "host-only-marker"
    marker.write_text("host\n")
    marker.chmod(0o644)
    got = raw(team, 60001, f"SHARED = {str(team.shared)!r}\n" + r"""
d = os.open(SHARED, os.O_RDONLY | os.O_DIRECTORY)
r, w = os.pipe()
s = conn()
code = "cd /proc/self/fd/0 && echo *"
socket.send_fds(s, [frame({"v": 1, "op": "exec", "env": "box", "argv": ["sh", "-c", code],
                           "stdin_fd": 0, "stdout_fd": 1, "stderr_fd": 2})], [d, w, w])
os.close(w)
out = b""
while chunk := os.read(r, 65536):
    out += chunk
print(json.dumps({"out": out.decode(errors="replace"), "reply": reply(s)}))
""")
    assert marker.name not in got["out"], got
    assert got["reply"] and got["reply"]["exit"] == 2, got
