"""`envctl exec` on the real kernel, in a sandbox: exit codes, signals and stdio pass through;
the command is isolated (its own PID namespace and /proc, hostname, network, rootfs under
pivot_root that a chroot trick cannot leave, no mount, the device allow-list, Docker's
capability set for root and none for other users, no_new_privs); arguments reach it
literally; it runs as the user asked for and never silently as root; it runs in a cgroup of
its own that is gone afterwards, on the environment's CPUs; and `down` leaves nothing."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

import pytest

from tests.integration.sandbox import CGROUP_ROOT, stderr_of

pytestmark = pytest.mark.root

# Docker's default capability set (CHOWN DAC_OVERRIDE FSETID FOWNER MKNOD NET_RAW SETGID
# SETUID SETFCAP SETPCAP NET_BIND_SERVICE SYS_CHROOT KILL AUDIT_WRITE), as a Docker
# container's /proc/self/status shows it.
DOCKER_CAPS = 0xA80425FB

ARGV = r"""
#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) { fputs(argv[i], stdout); putchar(0); }
    return 0;
}
"""
# The chroot escape: as root, chroot into a subdirectory, climb out with .. (chroot does not
# change the working directory), chroot to where that led. Without pivot_root that is the
# host's root; here it must still be the environment's.
ESCAPE = r"""
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/x-%d", (int)getpid());
    if (mkdir(dir, 0700) || chroot(dir)) { perror("mkdir/chroot x"); return 2; }
    for (int i = 0; i < 64; i++) chdir("..");
    if (chroot(".")) { perror("chroot ."); return 2; }
    struct stat st;
    printf("marker %s\n", stat(argv[1], &st) == 0 ? "VISIBLE" : "hidden");
    printf("rootfs %s\n", stat("/etc/hostname", &st) == 0 ? "yes" : "no");
    return 0;
}
"""


@pytest.fixture(scope="module")
def programs():
    """An argv printer and a static chroot-escape program, built under /var/tmp (every
    environment mounts its own /tmp), and a marker file outside any rootfs."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (scripts/install-deps installs it)")
    d = Path(tempfile.mkdtemp(prefix="envctl-test-exec-", dir="/var/tmp"))
    marker = Path(tempfile.mkstemp(prefix="envctl-marker-", dir="/var/tmp")[1])
    try:
        (d / "argv.c").write_text(ARGV)
        (d / "escape.c").write_text(ESCAPE)
        res = subprocess.run(["gcc", "-o", str(d / "argv"), str(d / "argv.c")],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        res = subprocess.run(["gcc", "-static", "-o", str(d / "escape"), str(d / "escape.c")],
                             capture_output=True, text=True)
        escape = str(d / "escape") if res.returncode == 0 else None  # no libc.a: skipped
        shutil.copy(d / "argv", d / "private")
        (d / "private").chmod(0o700)
        yield {"argv": str(d / "argv"), "escape": escape, "marker": str(marker),
               "private": str(d / "private")}
    finally:
        shutil.rmtree(d)
        marker.unlink()


def two_cpus() -> bool:
    return len(os.sched_getaffinity(0)) >= 2 and 1 in os.sched_getaffinity(0)


def up_box(sb, programs, *, network: bool = False, extra: str = "") -> None:
    bins = ["sh", "bash", "cat", "ls", "true", "sleep", "mkdir", "mknod", "mount", "touch", "stty",
            "grep", "timeout", "ip", programs["argv"], programs["private"]]
    bins += [programs["escape"]] if programs["escape"] else []
    spec = "name: box\nkind: cpu\nrootfs:\n  binaries: [" + ", ".join(
        f'"{b}"' for b in bins) + "]\n  env: {FOO: bar}\n"
    if two_cpus():
        spec += "resources:\n  cpu: {dedicated: \"1\"}\n"
    if network:
        spec += "network: {address: 10.231.0.2, bridge_address: 10.231.0.1/24}\n"
    sb.write_spec("box", spec + extra)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr


def down_box(sb) -> None:
    res = sb.envctl("down", "box")
    assert res.returncode == 0, res.stderr
    assert sb.residue() == {}


def ex(sb, *argv: str, user: str | None = "root", env: dict[str, str] | None = None,
       input: str | None = None) -> subprocess.CompletedProcess:
    opts = ["--user", user] if user is not None else []
    return sb.run(sys.executable, "-m", "envctl", "exec", "box", *opts, "--", *argv,
                  env=env, input=input)


def status_field(text: str, name: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith(name + ":"))


def test_exit_codes_signals_and_stdio_pass_through(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    assert ex(sb, "sh", "-c", "exit 3").returncode == 3
    assert ex(sb, "sh", "-c", "kill -TERM $$").returncode == 128 + signal.SIGTERM
    assert ex(sb, "sh", "-c", "kill -KILL $$").returncode == 128 + signal.SIGKILL
    res = ex(sb, "sh", "-c", "echo out; echo err >&2")
    assert (res.returncode, res.stdout, res.stderr) == (0, "out\n", "err\n")
    res = ex(sb, "cat", input="data\nmore data\n")
    assert (res.returncode, res.stdout) == (0, "data\nmore data\n")
    assert ex(sb, "true").stdout == ""

    # A signal envctl receives goes to the command: killed by SIGTERM it exits 143, where
    # envctl itself dying of the signal would show as -15.
    cmd = ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
           "exec", "box", "--user", "root", "--", "sh", "-c", "echo ready; exec sleep 60"]
    proc = subprocess.Popen(cmd, env=sb.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "ready\n", stderr_of(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    down_box(sb)


def test_the_command_is_isolated(sandbox, programs):
    sb = sandbox
    up_box(sb, programs, network=True)
    host_init = Path("/proc/1/cmdline").read_bytes()
    res = ex(sb, "cat", "/proc/1/cmdline")
    assert res.returncode == 0, res.stderr
    assert res.stdout.encode() != host_init and b"envctl" in res.stdout.encode()
    # Its own PID namespace: the init, the shell and ls.
    res = ex(sb, "sh", "-c", "ls /proc")
    pids = sorted(int(p) for p in res.stdout.split() if p.isdigit())
    assert pids and pids[0] == 1 and len(pids) <= 3, pids
    assert ex(sb, "cat", "/proc/sys/kernel/hostname").stdout == "box\n"
    # The network namespace of the environment: its own interface, none of the sandbox's.
    net = ex(sb, "cat", "/proc/net/dev").stdout
    names = {line.split(":")[0].strip() for line in net.splitlines()[2:]}
    assert names == {"lo", "eth0"}, names

    # A file of the host outside the rootfs is not there, not even by name.
    res = ex(sb, "cat", programs["marker"])
    assert res.returncode != 0 and "No such file" in res.stderr
    assert Path(programs["marker"]).name not in ex(sb, "ls", "/var/tmp").stdout

    # No mount, no remount: /sys and the rootfs stay read-only.
    for target in ("/sys", "/"):
        res = ex(sb, "mount", "-o", "remount,rw", target)
        assert res.returncode != 0, res.stdout
        res = ex(sb, "touch", f"{target.rstrip('/')}/x-{os.getpid()}")
        assert res.returncode != 0 and "Read-only file system" in res.stderr
    assert ex(sb, "mount", "-t", "tmpfs", "t", "/tmp").returncode != 0
    # The host-wide sysctls are read-only (the job is root, with DAC_OVERRIDE).
    res = ex(sb, "sh", "-c", "echo 1 > /proc/sys/vm/drop_caches")
    assert res.returncode != 0 and "Read-only file system" in res.stderr

    # The chroot trick lands in the rootfs again: the marker stays hidden.
    if programs["escape"]:
        res = ex(sb, programs["escape"], programs["marker"])
        assert res.returncode == 0, res.stderr
        assert res.stdout == "marker hidden\nrootfs yes\n"

    # mknod: root inside is the root of a user namespace, which never makes a device node,
    # not even one the environment's device allow-list has (MKNOD is in its set); with
    # runtime.userns: false the allow-list alone decides (test_mknod_without_userns).
    for kind, major, minor in (("c", "1", "3"), ("b", "8", "0")):
        res = ex(sb, "mknod", f"/tmp/dev-{os.getpid()}", kind, major, minor)
        assert res.returncode != 0 and "Operation not permitted" in res.stderr

    # Capabilities: Docker's default set for root, none for another user; no_new_privs.
    status = ex(sb, "cat", "/proc/self/status").stdout
    for field in ("CapBnd", "CapEff", "CapPrm"):
        assert int(status_field(status, field), 16) == DOCKER_CAPS, field
    assert int(status_field(status, "CapInh"), 16) == 0
    assert int(status_field(status, "CapAmb"), 16) == 0
    assert status_field(status, "NoNewPrivs") == "1"
    status = ex(sb, "cat", "/proc/self/status", user="65534").stdout
    for field in ("CapBnd", "CapEff", "CapPrm", "CapInh", "CapAmb"):
        assert int(status_field(status, field), 16) == 0, field
    assert status_field(status, "NoNewPrivs") == "1"
    down_box(sb)


def test_mknod_without_userns(sandbox, programs):
    """Root of the host inside (runtime.userns: false): an allowed device can be made (the
    capability is there), any other is refused by the environment's device allow-list."""
    sb = sandbox
    up_box(sb, programs, extra="runtime: {userns: false}\n")
    res = ex(sb, "mknod", f"/tmp/null-{os.getpid()}", "c", "1", "3")
    assert res.returncode == 0, res.stderr
    res = ex(sb, "mknod", f"/tmp/sda-{os.getpid()}", "b", "8", "0")
    assert res.returncode != 0 and "Operation not permitted" in res.stderr
    down_box(sb)


def test_env_and_workdir_as_docker_exec_takes_them(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    script = 'echo "$A|$B|$FOO|$(pwd)"'
    for opts in (["-e", "A=1", "--env", "B=two words", "-w", "/tmp"],
                 ["--env=A=1", "--env=B=two words", "--workdir=/tmp"]):
        res = sb.run(sys.executable, "-m", "envctl", "exec", "box", "--user", "root", *opts,
                     "--", "sh", "-c", script)
        assert (res.returncode, res.stdout) == (0, "1|two words|bar|/tmp\n"), res.stderr
    for bad in (["-e", "NOEQUALS"], ["-w", "relative"]):
        res = sb.run(sys.executable, "-m", "envctl", "exec", "box", "--user", "root", *bad,
                     "--", "true")
        assert res.returncode == 2 and bad[0] in res.stderr, res.stderr
    down_box(sb)


def test_arguments_reach_the_program_literally(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    args = ["$(touch /tmp/pwned1)", "`touch /tmp/pwned2`", "a; touch /tmp/pwned3",
            "'single' \"double\"", "line one\nline two", "-n", "--help", "|| touch /tmp/pwned4",
            "*", "$HOME", ""]
    res = ex(sb, programs["argv"], *args)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\0")[:-1] == args
    # A leading '-' as the command itself is a program name, not an option of envctl.
    res = ex(sb, "-n")
    assert res.returncode == 127 and "-n: command not found" in res.stderr
    # Nothing ran: neither inside (the environment's /tmp) nor on the host.
    left = ex(sb, "ls", "/tmp").stdout.split()
    assert not [f for f in left if f.startswith("pwned")], left
    assert not list(Path("/tmp").glob("pwned*"))
    down_box(sb)


# Accepts connections on the address and port given and prints a line for each; prints
# "listening" once bound.
LISTEN = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
while True:
    c, peer = s.accept()
    print("hit", peer[0], flush=True)
    c.close()
"""


@contextlib.contextmanager
def gateway_and_peer(sb, port: int):
    """Listeners at the gateway (10.231.0.1, the sandbox's side of the bridge) and in
    environment `peer` (10.231.0.3), each printing "hit ADDR" per connection; the peer shown
    reachable from the host side first. Yields the two processes."""
    gateway = sb.popen(sys.executable, "-c", LISTEN, "10.231.0.1", str(port))
    peer = sb.popen("ip", "netns", "exec", "peer", sys.executable, "-c", LISTEN, "10.231.0.3",
                    str(port))
    try:
        for proc in (gateway, peer):
            assert proc.stdout.readline() == "listening\n", stderr_of(proc)
        res = sb.run("bash", "-c", f"exec 3<>/dev/tcp/10.231.0.3/{port}")
        assert res.returncode == 0, res.stderr
        assert peer.stdout.readline().startswith("hit 10.231.0.1")
        yield gateway, peer
    finally:
        for proc in (gateway, peer):
            proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()


def test_another_isolated_environment_is_out_of_reach(sandbox, programs):
    """From inside `exec`, the environment reaches its gateway but not a second environment
    on the same bridge (isolate: true, the default), not even at a port that is listening."""
    sb = sandbox
    up_box(sb, programs, network=True)
    sb.write_spec("peer", "name: peer\nkind: cpu\n"
                  "network: {address: 10.231.0.3, bridge_address: 10.231.0.1/24}\n")
    res = sb.envctl("up", "peer")
    assert res.returncode == 0, res.stderr
    port = 9000 + os.getpid() % 1000

    def connect(address: str) -> subprocess.CompletedProcess:
        # bash's /dev/tcp: a plain connect(2); a dropped SYN is cut short by `timeout`.
        return ex(sb, "timeout", "5", "bash", "-c", f"exec 3<>/dev/tcp/{address}/{port}")

    with gateway_and_peer(sb, port) as (gateway, peer):
        res = connect("10.231.0.1")
        assert res.returncode == 0, res.stderr  # the same path works to the gateway
        assert gateway.stdout.readline().startswith("hit 10.231.0.2")
        res = connect("10.231.0.3")
        assert res.returncode != 0, res.stdout
        peer.kill()
        assert "hit" not in peer.stdout.read()  # the attempt never arrived
        # Nor through a route of its own via the host: the environment cannot add one (no
        # CAP_NET_ADMIN in the default set), and the host's forwarding drops it anyway.
        res = ex(sb, "ip", "route", "add", "10.231.0.3/32", "via", "10.231.0.1")
        assert res.returncode != 0 and "Operation not permitted" in res.stderr
    assert sb.envctl("down", "peer").returncode == 0
    down_box(sb)


def test_users_never_silently_root(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    no_sudo = {"SUDO_UID": "", "SUDO_GID": ""}
    res = ex(sb, "cat", "/proc/self/status", user="65534")
    assert res.returncode == 0, res.stderr
    assert status_field(res.stdout, "Uid").split()[:2] == ["65534", "65534"]
    assert status_field(res.stdout, "Gid").split()[0] == "65534"
    res = ex(sb, "cat", "/proc/self/status", user="nobody")
    assert status_field(res.stdout, "Uid").split()[0] == "65534"
    res = ex(sb, "cat", "/proc/self/status", user=None, env=no_sudo)
    assert res.returncode == 2 and res.stdout == ""
    assert "--user" in res.stderr and "root" in res.stderr
    # Through sudo, the user behind it.
    res = ex(sb, "cat", "/proc/self/status", user=None,
             env={"SUDO_UID": "65534", "SUDO_GID": "65534"})
    assert status_field(res.stdout, "Uid").split()[0] == "65534"
    for root in ("root", "0"):
        res = ex(sb, "cat", "/proc/self/status", user=root, env=no_sudo)
        assert status_field(res.stdout, "Uid").split()[0] == "0"
    res = ex(sb, "true", user="no-such-user")
    assert res.returncode == 2 and "no-such-user" in res.stderr
    # As another user, the rootfs's files are as its permissions say (a 0700 program of
    # root's, copied in with its mode).
    res = ex(sb, "cat", programs["private"], user="65534")
    assert res.returncode != 0 and "Permission denied" in res.stderr
    down_box(sb)


def _exec_cgroups(sb) -> list[str]:
    return [p for p in sb.cgroups() if "/exec-" in p]


def test_per_exec_cgroup_and_cpus(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    cmd = ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
           "exec", "box", "--user", "root", "--", "sh", "-c",
           "cat /proc/self/status; echo ready; read x; echo done"]
    proc = subprocess.Popen(cmd, env=sb.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while (line := proc.stdout.readline()) not in ("ready\n", ""):
            lines.append(line)
        assert line == "ready\n", stderr_of(proc)
        status = "".join(lines)
        # nsenter execs envctl: the Popen's pid is envctl's, and names its cgroup.
        name = f"exec-{proc.pid}"
        rel = f"/{sb.cgroup_parent}/box/{name}"
        found = _exec_cgroups(sb)
        assert found and all(p.endswith(rel) for p in found), found
        assert len(found) == len(list(CGROUP_ROOT.glob(f"*/{sb.cgroup_parent}/box")))
        members = {int(p) for p in Path(found[0], "cgroup.procs").read_text().split()}
        shells = [p for p in members if Path(f"/proc/{p}/comm").read_text() == "sh\n"]
        assert len(shells) == 1, members
        text = Path(f"/proc/{shells[0]}/cgroup").read_text()
        assert all(line.endswith(rel) for line in text.splitlines()
                   if not line.startswith("0::") and "name=" not in line), text
        # Inside, the cgroup namespace starts there.
        assert "0::/\n" in ex(sb, "cat", "/proc/self/cgroup").stdout
        proc.stdin.write("x\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "done\n"
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(BrokenPipeError):
                stream.close()
    assert _exec_cgroups(sb) == []
    want = "1" if two_cpus() else None
    allowed = status_field(status, "Cpus_allowed_list")
    if want:
        assert allowed == want
    else:
        host = sorted(os.sched_getaffinity(0))
        assert allowed in (f"{host[0]}-{host[-1]}", ",".join(map(str, host)))
    down_box(sb)


LAUNCH = r"""
import json, os, sys
from envctl.host.context import Host
from envctl.runtime.context import EnvContext
from envctl.runtime import launch as rl

src, cpus = sys.argv[1], tuple(json.loads(sys.argv[2]))
ctx = EnvContext.load(Host.from_env(), "box")
user = rl.resolve_user("root", ctx, {})
# Root inside is the user namespace's root, host uid ctx.userns: the bind is its to write.
os.chown(src, ctx.userns, ctx.userns)
out = []
for read_only in (True, False):
    dirs = rl.create_cgroup(ctx, "job-1", cpus=cpus or None)
    status_r, status_w = os.pipe()
    r, w = os.pipe()
    try:
        started = rl.start(rl.Launch(
            ctx, ["sh", "-c", "cat /opt/in; touch /opt/new; "
                  "grep Cpus_allowed_list /proc/self/status; exit 4"],
            rl.job_environ(ctx, user), user, cpus=cpus or None,
            cgroup_dirs=dirs, binds=[rl.Bind(src, "/opt", read_only)], stdio=(0, w, w),
            status_fd=status_w))
        os.close(status_w)
        os.close(w)
        code = started.wait()
        text = os.read(r, 65536).decode()
        out.append({"code": code, "status": os.read(status_r, 100).decode(), "out": text})
    finally:
        rl.remove_cgroup(ctx, "job-1")
print(json.dumps(out))
"""


def test_binds_status_and_a_cpu_subset_through_the_api(sandbox, programs, tmp_path):
    """What the job system uses: a per-launch bind (read-only, then read-write), the job's raw
    wait status on status_fd, a cgroup of the launch's own on a subset of the CPUs."""
    sb = sandbox
    up_box(sb, programs)
    src = tmp_path / "bind-src"
    src.mkdir()
    (src / "in").write_text("from the host\n")
    cpus = [1] if two_cpus() else []
    res = sb.run(sys.executable, "-c", LAUNCH, str(src), json.dumps(cpus))
    assert res.returncode == 0, res.stderr
    ro, rw = json.loads(res.stdout)
    for run in (ro, rw):
        assert run["code"] == 4 and run["status"] == f"{4 << 8}\n"
        assert run["out"].startswith("from the host\n")
        if cpus:
            assert run["out"].endswith("Cpus_allowed_list:\t1\n")
    assert "Read-only file system" in ro["out"] and "touch" in ro["out"]
    assert "touch" not in rw["out"] and (src / "new").exists()
    assert _exec_cgroups(sb) == [] and not [p for p in sb.cgroups() if "job-1" in p]
    down_box(sb)


JOIN_FAILS = r"""
import json, os, sys
from envctl.host.context import Host
from envctl.runtime.context import EnvContext
from envctl.runtime import launch as rl

def children():
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                    found.append(d)
        except OSError:
            pass  # gone meanwhile
    return found


ctx = EnvContext.load(Host.from_env(), "box")
user = rl.resolve_user("root", ctx, {})
out = {}
for case in ("gone cgroup", "bad bind"):
    dirs = rl.create_cgroup(ctx, "job-1")
    binds = []
    if case == "gone cgroup":
        os.rmdir(dirs[-1])  # the caller's join fails while the launcher sets up
    else:
        binds = [rl.Bind("/nonexistent-envctl-source", "/opt")]  # the launcher fails first
    try:
        rl.start(rl.Launch(ctx, ["true"], rl.job_environ(ctx, user), user, cgroup_dirs=dirs,
                           binds=binds))
        out[case] = "started"
    except rl.LaunchError as exc:
        out[case] = {"step": exc.step, "message": str(exc), "gone": str(dirs[-1])}
    finally:
        rl.remove_cgroup(ctx, "job-1")
    out[case + " children"] = children()
print(json.dumps(out))
"""


def test_a_failed_cgroup_join_or_setup_is_reported_and_leaves_nothing(sandbox, programs):
    """The caller joins the launcher to its cgroup while the launcher sets up: a join that
    fails (the cgroup removed meanwhile) names the step and the directory, and a launcher that
    failed first (a bind) reports its own step, not the join's; no child is left behind."""
    sb = sandbox
    up_box(sb, programs)
    res = sb.run(sys.executable, "-c", JOIN_FAILS)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    gone = out["gone cgroup"]
    assert gone["step"] == "join cgroup", gone
    assert gone["message"].startswith("enter environment 'box': join cgroup: "), gone
    assert gone["gone"] in gone["message"], gone
    bad = out["bad bind"]
    assert bad["step"] == "bind /opt" and "No such file" in bad["message"], bad
    assert out["gone cgroup children"] == [] and out["bad bind children"] == [], out
    assert not [p for p in sb.cgroups() if "job-1" in p]
    down_box(sb)


def test_kill_9_of_envctl_takes_the_command_with_it(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    cmd = ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
           "exec", "box", "--user", "root", "--", "sh", "-c", "echo ready; exec sleep 60"]
    proc = subprocess.Popen(cmd, env=sb.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "ready\n", stderr_of(proc)
        found = _exec_cgroups(sb)
        pids = {int(p) for p in Path(found[0], "cgroup.procs").read_text().split()}
        assert len(pids) == 3  # the launcher, the init, the command
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    # Its (empty) cgroup is left for `down`, which removes it with the environment's.
    down_box(sb)


def test_not_up_missing_command_and_a_terminal(sandbox, programs):
    sb = sandbox
    res = ex(sb, "true")  # no spec and no journal of that name
    assert res.returncode == 2 and "no environment 'box'" in res.stderr, res.stderr
    sb.write_spec("box", "name: box\nkind: cpu\n")  # a spec, never brought up
    res = ex(sb, "true")
    assert res.returncode == 2 and "environment 'box' is not up" in res.stderr, res.stderr
    up_box(sb, programs)
    res = ex(sb, "no-such-command", "arg")
    assert res.returncode == 127 and "no-such-command: command not found" in res.stderr
    res = ex(sb, "/bin/no-such-file")
    assert res.returncode == 127 and "no such file" in res.stderr
    res = ex(sb, "/etc/hostname")  # there, but not executable
    assert res.returncode == 126 and "Permission denied" in res.stderr
    assert _exec_cgroups(sb) == []

    # stdin and stdout on a terminal: the command gets a terminal of its own, of that size,
    # and what is typed reaches it.
    out, code = _on_a_terminal(sb, "[ -t 0 ] && [ -t 1 ] && echo TTY; stty size; echo $TERM; "
                                   "read line; echo got $line; exit 5", typed=b"typed words\r")
    assert code == 5
    # The terminal echoes what is typed, then the command's output follows.
    assert out.replace(b"\r\n", b"\n") == b"TTY\n33 101\nvt100\ntyped words\ngot typed words\n", \
        out
    down_box(sb)


def _on_a_terminal(sb, script: str, *, typed: bytes) -> tuple[bytes, int]:
    """Run `envctl exec … sh -c script` with a terminal (33x101) as stdin, stdout and stderr,
    type `typed` into it; what the terminal showed, and the exit status."""
    import fcntl

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    cmd = ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
           "exec", "box", "--user", "root", "--", "sh", "-c", script]
    proc = subprocess.Popen(cmd, env=sb.env({"TERM": "vt100"}), stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every process holding the terminal is gone
                break
            if not chunk:
                break
            out += chunk
            if typed and b"vt100" in out:  # the command is reading now
                os.write(master, typed)
                typed = b""
        return out, proc.wait(timeout=30)
    finally:
        os.close(master)
        proc.kill()
        proc.wait()


def test_the_spec_chooses_the_capabilities_root_keeps(sandbox):
    """runtime.capabilities replaces the default set for root (read from the journal at each
    launch); another user still keeps none."""
    sb = sandbox
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs: {binaries: [cat]}\n"
                         "runtime: {capabilities: [cap_chown, NET_BIND_SERVICE]}\n")
    assert sb.envctl("up", "box").returncode == 0
    status = ex(sb, "cat", "/proc/self/status").stdout
    want = (1 << 0) | (1 << 10)  # CAP_CHOWN, CAP_NET_BIND_SERVICE
    for field in ("CapBnd", "CapEff", "CapPrm"):
        assert int(status_field(status, field), 16) == want, field
    status = ex(sb, "cat", "/proc/self/status", user="65534").stdout
    assert int(status_field(status, "CapBnd"), 16) == 0
    # An empty list: root keeps nothing either.
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs: {binaries: [cat]}\n"
                         "runtime: {capabilities: []}\n")
    assert sb.envctl("up", "box").returncode == 0
    status = ex(sb, "cat", "/proc/self/status").stdout
    assert int(status_field(status, "CapEff"), 16) == 0
    down_box(sb)


# Starts a launch with a pseudo-terminal whose init fails at once (launch.start's `init` hook,
# as envctl.runtime.gvisor uses it): the caller must get the error, not wait for a terminal.
FAILING_INIT = """
import os, sys
from envctl.host.context import Host
from envctl.runtime import launch as L
from envctl.runtime.context import EnvContext

def init(launch, plan, alive_r):
    L._fail(plan.err_w, "the test's step", OSError(5, "made to fail"))

ctx = EnvContext.load(Host.from_env(), "box")
launch = L.Launch(ctx, ["true"], {}, L.User(0, 0), pty=True)
try:
    L.start(launch, init=init)
except L.LaunchError as exc:
    print("error:", exc)
"""


def test_a_launch_with_a_terminal_that_fails_reports_instead_of_hanging(sandbox, programs):
    sb = sandbox
    up_box(sb, programs)
    res = sb.run(sys.executable, "-c", FAILING_INIT, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("error:") and "the test's step" in res.stdout, res.stdout
    down_box(sb)


def test_a_terminal_among_execs_stdio_is_relayed_not_handed_over(sandbox, programs):
    """`envctl exec ENV -- cmd | grep …`: stdin (and stderr) are the caller's terminal, stdout
    a pipe. The job never gets the terminal (what holds its descriptor may change its line
    discipline or modes): stderr is relayed through a pipe; stdin is /dev/null, or with -i
    (as docker exec -i) a relayed pipe that what is typed reaches, up to the end of input."""
    import fcntl

    sb = sandbox
    up_box(sb, programs)
    script = ("[ -t 0 ] && echo stdin-is-a-terminal; [ -t 2 ] && echo stderr-is-a-terminal; "
              "read line; echo got $line; stty sane 2>/dev/null || echo no-stty; cat; "
              "echo to-stderr >&2")
    for flags, typed, want in (
            (["-i"], b"typed words\nrest\n\x04", b"got typed words\nno-stty\nrest\n"),
            ([], b"", b"got\nno-stty\n")):
        master, slave = pty.openpty()
        try:
            proc = subprocess.Popen(
                ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m",
                 "envctl", "exec", "box", "--user", "root", *flags, "--", "sh", "-c", script],
                env=sb.env(), stdin=slave, stdout=subprocess.PIPE, stderr=slave)
            if typed:
                os.write(master, typed)  # ^D: the terminal's end of input
            out, _ = proc.communicate(timeout=60)
            ldisc = struct.unpack("i", fcntl.ioctl(slave, 0x5424, b"\0" * 4))[0]  # TIOCGETD
            os.set_blocking(master, False)
            shown = b""
            with contextlib.suppress(BlockingIOError):
                shown = os.read(master, 4096)
        finally:
            os.close(slave)
            os.close(master)
        assert proc.returncode == 0 and out == want, (flags, out)
        assert b"to-stderr" in shown, shown  # stderr, relayed to the terminal
        assert ldisc == 0  # N_TTY, as it was
    assert _exec_cgroups(sb) == []
    down_box(sb)
