"""The partition as a security boundary, tried as an attacker inside would (root with the
default capabilities, and `nobody`), on the real kernel in a sandbox. Each test makes the
attempt and asserts the host is untouched:

- a /dev/null planted as a symlink to a host file (runc's CVE-2025-31133): the next launch's
  masks never bind it, and no launch can plant it (/dev is read-only in every launch);
- /dev, /tmp and /dev/shm captured across launches: each launch has its own;
- keyrings: a job reaches neither the host's keyrings nor the caller's session keyring;
- seccomp (Docker's default profile): a nested user namespace (the way to nf_tables'
  NEWTABLE), keyctl, io_uring, userfaultfd, perf_event_open, fsopen, a cgroup made at the
  host's hierarchy root from a nested user+cgroup namespace;
- PID 1 of the launch: no capability but CAP_KILL, no descriptor of the host, not dumpable,
  the job's seccomp filter, neither the host's command line nor the caller's environment;
  even a spec that adds SYS_PTRACE reaches nothing of the host through it.

The results of every attempt are written to ENVCTL_BOUNDARY_TABLE (when set) for
docs/security.md's table."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

# One program, one attempt per argument; prints "NAME ok" or "NAME EPERM"/"NAME <errno>".
PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/keyctl.h>

static void report(const char *name, long r) {
    if (r < 0) printf("%s %s\n", name, strerrorname_np(errno));
    else printf("%s ok %ld\n", name, r);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        long r = -1;
        errno = 0;
        if (!strcmp(a, "userns")) r = unshare(CLONE_NEWUSER);
        else if (!strcmp(a, "userns-net")) r = unshare(CLONE_NEWUSER | CLONE_NEWNET);
        else if (!strcmp(a, "userns-cgroup"))
            r = unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP);
        else if (!strcmp(a, "keyctl-user"))
            r = syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING, 0);
        else if (!strcmp(a, "keyctl-session"))
            r = syscall(SYS_keyctl, KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0);
        else if (!strcmp(a, "add_key"))
            r = syscall(SYS_add_key, "user", "envctl-probe", "x", 1, KEY_SPEC_SESSION_KEYRING);
        else if (!strcmp(a, "io_uring")) {
            char params[120] = {0};
            r = syscall(SYS_io_uring_setup, 1, params);
        }
        else if (!strcmp(a, "userfaultfd")) r = syscall(SYS_userfaultfd, 0);
        else if (!strcmp(a, "perf_event_open")) {
            char attr[128] = {0};
            *(unsigned *)(attr + 4) = sizeof attr;
            r = syscall(SYS_perf_event_open, attr, 0, -1, -1, 0);
        }
        else if (!strcmp(a, "fsopen")) r = syscall(SYS_fsopen, "tmpfs", 0);
        else if (!strcmp(a, "bpf")) r = syscall(SYS_bpf, 0, NULL, 0);
        else if (!strcmp(a, "getpid")) r = getpid();
        else if (!strcmp(a, "euid")) r = geteuid();
        else { printf("%s unknown\n", a); continue; }
        report(a, r);
    }
    printf("Seccomp ");
    fflush(stdout);
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "Seccomp:", 8)) fputs(line + 9, stdout);
    return 0;
}
"""

ATTEMPTS = ("userns", "userns-net", "userns-cgroup", "keyctl-user", "keyctl-session",
            "add_key", "io_uring", "userfaultfd", "perf_event_open", "fsopen", "bpf")


@pytest.fixture(scope="module")
def probe():
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (scripts/install-deps installs it)")
    d = Path(tempfile.mkdtemp(prefix="envctl-test-boundary-", dir="/var/tmp"))
    try:
        (d / "probe.c").write_text(PROBE)
        res = subprocess.run(["gcc", "-o", str(d / "probe"), str(d / "probe.c")],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        yield str(d / "probe")
    finally:
        shutil.rmtree(d)


@pytest.fixture
def secret():
    """A root-only host file outside every rootfs: its content must never change."""
    fd, path = tempfile.mkstemp(prefix="envctl-secret-", dir="/var/tmp")
    os.write(fd, b"host secret\n")
    os.close(fd)
    os.chmod(path, 0o600)
    yield Path(path)
    os.unlink(path)


def up_box(sb, probe: str, *, extra: str = "") -> Path:
    bins = ["sh", "cat", "ls", "ln", "touch", "echo", "readlink", "grep", "tr", "chmod", probe]
    spec = ("name: box\nkind: cpu\nrootfs:\n  binaries: [" + ", ".join(f'"{b}"' for b in bins)
            + "]\n" + extra)
    sb.write_spec("box", spec)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    return sb.state / "rootfs" / "box"


def ex(sb, *argv: str, user: str = "root") -> subprocess.CompletedProcess:
    return sb.run(sys.executable, "-m", "envctl", "exec", "box", "--user", user, "--", *argv)


def down_box(sb, *, purge: bool = False) -> None:
    res = sb.envctl("down", "box", *(["--purge"] if purge else []))
    assert res.returncode == 0, res.stderr
    assert sb.residue() == {}


def record(name: str, outcome: dict[str, str]) -> None:
    """Add this run's outcomes to the table docs/security.md is made from."""
    out = os.environ.get("ENVCTL_BOUNDARY_TABLE")
    if not out:
        return
    path = Path(out)
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault(name, {}).update(outcome)
    path.write_text(json.dumps(table, indent=1, sort_keys=True))


def in_env_mntns(sb, script: str) -> subprocess.CompletedProcess:
    """Run `script` in the environment's persistent mount namespace, as root of the host:
    the state a root launch of an older envctl could leave behind."""
    return sb.run("nsenter", f"--mount={sb.run_dir}/mnt.d/box", "--", "sh", "-c", script)


def test_a_planted_dev_null_never_reaches_the_host(sandbox, probe, secret):
    sb = sandbox
    root = up_box(sb, probe)
    # No launch can plant it: /dev is read-only in every launch, root or not.
    for user in ("root", "nobody"):
        res = ex(sb, "ln", "-sf", str(secret), "/dev/null", user=user)
        assert res.returncode != 0, res.stdout
        assert "Read-only file system" in res.stderr or "Permission denied" in res.stderr
    # And where one is there anyway (the environment's /dev of an older envctl), the next
    # launch masks /proc with the host's own /dev/null, read-only, never with it.
    res = in_env_mntns(sb, f"rm {root}/dev/null && ln -s {secret} {root}/dev/null")
    assert res.returncode == 0, res.stderr
    res = ex(sb, "sh", "-c", "echo pwned >> /proc/keys; echo pwned >> /proc/timer_list; "
             "cat /proc/keys /proc/timer_list /proc/interrupts; ls /sys/firmware; echo done")
    assert res.returncode == 0, res.stderr
    # Masked: the files are the host's /dev/null (writes vanish), the directory is empty.
    assert (res.stdout, res.stderr) == ("done\n", "")
    assert secret.read_bytes() == b"host secret\n"
    record("planted /dev/null symlink", {"native": "host file untouched"})
    # `up` repairs the environment's /dev (the symlink is envctl's tmpfs's, not the host's).
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    assert secret.read_bytes() == b"host secret\n"
    assert ex(sb, "sh", "-c", "echo x > /dev/null").returncode == 0
    down_box(sb)


def test_dev_tmp_and_shm_are_each_launchs_own(sandbox, probe):
    sb = sandbox
    up_box(sb, probe)
    res = ex(sb, "sh", "-c", "echo root > /dev/shm/drop && echo root > /tmp/drop && "
             "touch /dev/drop; cat /dev/shm/drop /tmp/drop")
    assert res.stdout == "root\nroot\n", res.stderr
    assert "Read-only file system" in res.stderr  # /dev itself
    res = ex(sb, "sh", "-c", "ls -a /dev/shm /tmp; ls /dev", user="nobody")
    assert res.returncode == 0, res.stderr
    assert "drop" not in res.stdout, res.stdout
    # Each is a tmpfs of the launch, nosuid,nodev; /dev read-only.
    mounts = ex(sb, "cat", "/proc/self/mountinfo").stdout.splitlines()
    by_target = {line.split()[4]: line for line in mounts}
    for target in ("/tmp", "/dev/shm"):
        assert " - tmpfs " in by_target[target] and "nosuid,nodev" in by_target[target]
    assert by_target["/dev"].split()[5].startswith("ro,"), by_target["/dev"]
    record("/dev, /tmp, /dev/shm shared across launches", {"native": "per launch"})
    down_box(sb)


def test_a_launchs_terminal_is_its_own(sandbox, probe):
    """Each launch has a devpts instance of its own: root in another launch of the same
    environment sees no terminal of a user's attached `exec` (it could read what she types
    there: its DAC_OVERRIDE reaches every uid of its user namespace)."""
    import pty

    sb = sandbox
    up_box(sb, probe)
    master, slave = pty.openpty()
    cmd = ["nsenter", "-t", str(sb.pid), "-n", "-m", "--", sys.executable, "-m", "envctl",
           "exec", "box", "--user", "nobody", "--", "sh", "-c",
           "ls /dev/pts; echo ready; exec cat"]
    proc = subprocess.Popen(cmd, env=sb.env(), stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    try:
        seen = b""
        while b"ready" not in seen:
            chunk = os.read(master, 4096)  # EIO (the exec died): fails the test, with output
            assert chunk, seen
            seen += chunk
        assert b"0" in seen.split(b"ready")[0]  # its own terminal, pts/0 of its instance
        res = ex(sb, "sh", "-c", "ls /dev/pts")
        assert res.returncode == 0, res.stderr
        assert res.stdout.split() == ["ptmx"], res.stdout  # none of the other launch's
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    record("read another launch's terminal", {"native": "not there (devpts per launch)"})
    down_box(sb)


def probe_results(sb, probe: str, user: str) -> dict[str, str]:
    res = ex(sb, probe, *ATTEMPTS, "getpid", user=user)
    assert res.returncode == 0, res.stderr
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    return {k: v.strip().split()[0] for k, v in out.items()}


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_seccomp_refuses_the_kernel_attack_surface(sandbox, probe, user):
    sb = sandbox
    up_box(sb, probe)
    before = {p.name for p in Path("/sys/fs/cgroup").iterdir()}
    got = probe_results(sb, probe, user)
    assert got.pop("Seccomp") == "2", got
    assert got.pop("getpid") == "ok"
    # Everything Docker's default profile refuses, refused: EPERM, as Docker answers.
    assert got == {a: "EPERM" for a in ATTEMPTS}, got
    # No cgroup appeared at the host's hierarchy root.
    assert {p.name for p in Path("/sys/fs/cgroup").iterdir()} == before
    record(f"kernel attack surface as {user}", {"native": ", ".join(
        f"{k} {v}" for k, v in sorted(got.items()))})
    down_box(sb)


def test_unconfined_is_the_documented_opt_out(sandbox, probe):
    sb = sandbox
    up_box(sb, probe, extra="runtime: {seccomp: unconfined}\n")
    got = probe_results(sb, probe, "nobody")
    assert got["Seccomp"] == "0", got
    # Keyrings, reachable without a filter: the session keyring is the launch's own, never
    # the caller's, and root's user keyring is its user namespace's, never the host root's.
    mine = subprocess.run([probe, "keyctl-session", "keyctl-user"], capture_output=True,
                          text=True).stdout.splitlines()
    for user in ("nobody", "root"):
        theirs = ex(sb, probe, "keyctl-session", "keyctl-user", user=user).stdout.splitlines()
        assert theirs[0].startswith("keyctl-session ok "), theirs
        assert mine[0].startswith("keyctl-session ok ") and theirs[0] != mine[0]
        if user == "root":
            assert mine[1].startswith("keyctl-user ok ") and theirs[1] != mine[1], theirs
    record("keyrings (seccomp unconfined)", {"native": "own session keyring; root's user "
                                             "keyring is its user namespace's"})
    down_box(sb)


@pytest.mark.parametrize("userns", [True, False])
def test_root_inside_is_not_root_outside(sandbox, probe, tmp_path, userns):
    """A file root makes inside is owned by the environment's own host uid, a set-id one
    too; host files owned by root stay unwritable to root inside, DAC_OVERRIDE or not. With
    `runtime.userns: false` (the opt-out, run here to document what it costs) both hold no
    more: root inside is the host's root."""
    sb = sandbox
    hostdir = tmp_path / "hostdir"  # an operator's directory, bound read-write
    hostdir.mkdir()
    (hostdir / "f").write_text("root's\n")
    up_box(sb, probe, extra=f"mounts:\n  - {{source: {hostdir}, target: /srv}}\n"
           "  - {source: results, target: /results}\n"
           f"runtime: {{userns: {str(userns).lower()}}}\n")
    res = ex(sb, "sh", "-c", "echo pwned >> /srv/f; touch /srv/new; "
             f"cat {probe} > /results/p && chmod 4755 /results/p")
    planted = sb.state / "data" / "box" / "results" / "p"
    st = planted.stat()
    claims = json.loads((sb.state / "journal" / "box.json").read_text())["meta"]["claims"]
    base = claims["userns"]["base"] if userns else 0
    assert st.st_uid == base and st.st_mode & 0o4000, (st.st_uid, oct(st.st_mode))
    # Run by another host user (copied out of envctl's 0700 data directory as it is): the
    # set-uid bit gives it the environment's unprivileged uid, never root.
    copy = tmp_path / "p"
    subprocess.run(["cp", "-a", str(planted), str(copy)], check=True)
    tmp_path.chmod(0o755)
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          str(copy), "euid"], capture_output=True, text=True)
    assert run.stdout.splitlines()[0] == f"euid ok {base}", run.stdout + run.stderr
    column = "native" if userns else "native without userns"
    if userns:
        assert res.stderr.count("Permission denied") == 2, res.stderr
        assert (hostdir / "f").read_text() == "root's\n" and not (hostdir / "new").exists()
        assert base >= 0x70000000
        # What root inside still needs of the host-owned rootfs: its HOME opens.
        home = ex(sb, "sh", "-c", 'cd "$HOME" && ls -a .')
        assert home.returncode == 0 and home.stdout.split() == [".", ".."], home.stderr
        record("root-owned host file bound read-write", {column: "not writable"})
        record("set-uid file planted on a data mount, run by a host user",
               {column: "euid = the environment's own uid, not 0 (and <state>/data is 0700)"})
    else:
        assert res.stderr == "" and (hostdir / "new").exists(), res.stderr
        record("root-owned host file bound read-write", {column: "written"})
        record("set-uid file planted on a data mount, run by a host user",
               {column: "euid 0, where a host user can reach it (<state>/data is 0700)"})
    down_box(sb, purge=True)


@pytest.mark.parametrize("userns", [True, False])
def test_the_launchs_pid_1_gives_nothing_of_the_host(sandbox, probe, userns):
    sb = sandbox
    # SYS_PTRACE in the spec: the job may trace the init; what it finds there must be nothing.
    caps = "[CHOWN, DAC_OVERRIDE, FOWNER, SETUID, SETGID, KILL, SYS_PTRACE]"
    up_box(sb, probe, extra=f"runtime: {{capabilities: {caps}, userns: {str(userns).lower()}}}\n")
    res = ex(sb, "sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; "
             "grep -E '^(Cap(Eff|Prm|Bnd)|Seccomp|NoNewPrivs):' /proc/1/status; "
             "ls /proc/1/fd; echo environ; cat /proc/1/environ | tr '\\0' '\\n' | grep -c =; "
             "readlink /proc/1/root")
    lines = res.stdout.splitlines()
    assert lines[0].strip() == "envctl-init", lines
    status = dict(line.split(":\t") for line in lines[1:6])
    assert status == {"CapEff": "0000000000000020", "CapPrm": "0000000000000020",
                      "CapBnd": "0000000000000020", "NoNewPrivs": "1", "Seccomp": "2"}, status
    if userns:
        # Root inside is not the init's owner: its SYS_PTRACE is its user namespace's.
        assert res.stderr.count("Permission denied") == 2, res.stderr
        assert lines[6:] == ["environ", "0"], lines  # readlink /proc/1/root: nothing either
        outcome = "not traceable (another user namespace's); CAP_KILL only, seccomp"
    else:
        assert res.returncode == 0, res.stderr
        fds = lines[6:lines.index("environ")]
        assert fds == [], fds  # exec: no status pipe either; nothing of the host
        assert lines[lines.index("environ") + 1] == "0"  # the caller's environment: gone
        assert lines[-1] == "/"
        outcome = "CAP_KILL only, no fds, seccomp, environment and command line scrubbed"
    record("PID 1 with SYS_PTRACE in the spec",
           {"native" if userns else "native without userns": outcome})
    down_box(sb)


@pytest.mark.skipif(shutil.which("runsc") is None, reason="gVisor's runsc is not installed "
                    "(scripts/install-deps installs it)")
def test_the_same_attempts_under_gvisor(sandbox, probe, secret):
    """Under `isolation: gvisor` the job's system calls reach gVisor's Sentry, not the host's
    kernel: whatever the Sentry answers, the host is untouched (no cgroup at the host's
    hierarchy root, the host file behind a planted /dev/null unchanged)."""
    sb = sandbox
    root = up_box(sb, probe, extra="runtime: {isolation: gvisor, gvisor: {platform: ptrace}}\n")
    before = {p.name for p in Path("/sys/fs/cgroup").iterdir()}
    for user in ("root", "nobody"):
        res = ex(sb, probe, *ATTEMPTS, user=user)
        assert res.returncode == 0, res.stderr
        got = {k: v.strip().split()[0] for k, v in
               (line.split(" ", 1) for line in res.stdout.splitlines())}
        got.pop("Seccomp", None)
        record(f"kernel attack surface as {user}", {"gvisor": ", ".join(
            f"{k} {v}" for k, v in sorted(got.items()))})
    assert {p.name for p in Path("/sys/fs/cgroup").iterdir()} == before
    res = in_env_mntns(sb, f"rm {root}/dev/null && ln -s {secret} {root}/dev/null")
    assert res.returncode == 0, res.stderr
    ex(sb, "sh", "-c", "echo pwned >> /proc/keys; echo pwned > /dev/null; cat /proc/1/cmdline")
    assert secret.read_bytes() == b"host secret\n"
    record("planted /dev/null symlink", {"gvisor": "host file untouched"})
    res = sb.envctl("up", "box")  # repairs /dev before down
    assert res.returncode == 0, res.stderr
    down_box(sb)
