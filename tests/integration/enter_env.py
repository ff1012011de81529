"""Run a command inside an environment's rootfs the plain way, independent of envctl's runtime:
join its persistent mount namespace, unshare a private mount + PID namespace, mount /proc,
pivot_root into the rootfs, detach the old root, exec with /etc/environment's variables.

    python enter_env.py MNTNS_HOLDER ROOTFS [--cgroup DIR] -- ARGV...

Exits with the command's status (128+N for signal N); what fails before the exec goes to
stderr with exit 125."""

from __future__ import annotations

import ctypes
import os
import sys
import warnings  # noqa: F401 - os.execvpe imports it lazily, after the old root is gone

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
MNT_DETACH = 2
SYS_PIVOT_ROOT = 155

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        sys.stderr.write(f"enter_env: {what}: {os.strerror(err)}\n")
        os._exit(125)


def main() -> None:
    args = sys.argv[1:]
    sep = args.index("--")
    holder, root, opts, argv = args[0], args[1], args[2:sep], args[sep + 1:]
    cgroup = opts[opts.index("--cgroup") + 1] if "--cgroup" in opts else None
    fd = os.open(holder, os.O_RDONLY)
    check(libc.setns(fd, CLONE_NEWNS), "setns")
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.exit(128 - code if code < 0 else code)
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    os.chdir(root)
    check(libc.mount(b"proc", b"proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
          "mount proc")
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    env = {}
    with open("/etc/environment") as f:
        for line in f:
            key, _, value = line.rstrip("\n").partition("=")
            env[key] = value
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        sys.stderr.write(f"enter_env: exec {argv[0]}: {exc.strerror}\n")
        os._exit(127)


if __name__ == "__main__":
    main()
