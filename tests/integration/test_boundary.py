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
    else printf("%s ok\n", name);
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
    bins = ["sh", "cat", "ls", "ln", "touch", "echo", "readlink", "grep", "tr", probe]
    spec = ("name: box\nkind: cpu\nrootfs:\n  binaries: [" + ", ".join(f'"{b}"' for b in bins)
            + "]\n" + extra)
    sb.write_spec("box", spec)
    res = sb.envctl("up", "box")
    assert res.returncode == 0, res.stderr
    return sb.state / "rootfs" / "box"


def ex(sb, *argv: str, user: str = "root") -> subprocess.CompletedProcess:
    return sb.run(sys.executable, "-m", "envctl", "exec", "box", "--user", user, "--", *argv)


def down_box(sb) -> None:
    res = sb.envctl("down", "box")
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


def probe_results(sb, probe: str, user: str) -> dict[str, str]:
    res = ex(sb, probe, *ATTEMPTS, "getpid", user=user)
    assert res.returncode == 0, res.stderr
    out = dict(line.split(" ", 1) for line in res.stdout.splitlines())
    return {k: v.strip() for k, v in out.items()}


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
    # The session keyring is the launch's own, never the caller's, even without a filter.
    mine = subprocess.run([probe, "keyctl-session"], capture_output=True, text=True).stdout
    theirs = ex(sb, probe, "keyctl-session", user="nobody").stdout
    assert "keyctl-session ok" in theirs
    assert mine.splitlines()[0] == "keyctl-session ok"
    down_box(sb)


def test_the_launchs_pid_1_gives_nothing_of_the_host(sandbox, probe):
    sb = sandbox
    # SYS_PTRACE in the spec: the job may trace the init; what it finds there must be nothing.
    caps = ("[CHOWN, DAC_OVERRIDE, FOWNER, SETUID, SETGID, KILL, SYS_PTRACE]")
    up_box(sb, probe, extra=f"runtime: {{capabilities: {caps}}}\n")
    res = ex(sb, "sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; "
             "grep -E '^(Cap(Eff|Prm|Bnd)|Seccomp|NoNewPrivs):' /proc/1/status; "
             "ls /proc/1/fd; echo environ; cat /proc/1/environ | tr '\\0' '\\n' | grep -c =; "
             "readlink /proc/1/root")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].strip() == "envctl-init", lines
    status = dict(line.split(":\t") for line in lines[1:6])
    assert status == {"CapEff": "0000000000000020", "CapPrm": "0000000000000020",
                      "CapBnd": "0000000000000020", "NoNewPrivs": "1", "Seccomp": "2"}, status
    fds = lines[6:lines.index("environ")]
    assert fds == [], fds  # exec: no status pipe either; nothing of the host
    assert lines[lines.index("environ") + 1] == "0"  # the caller's environment: gone
    assert lines[-1] == "/"
    record("PID 1 with SYS_PTRACE in the spec", {"native": "CAP_KILL only, no fds, seccomp, "
                                                "scrubbed"})
    down_box(sb)
