"""The one entry path into an environment, for `exec`, jobs and the environment's service: new
namespaces, the per-launch cgroup, pivot_root into the rootfs, capabilities, the user, and the
exec of an argv list. No helper binary, no shell.

API (kept stable for the job system):

    Launch(ctx, argv, environ, user, *, cwd="/", cpus=None, cgroup_dirs=[], caps=None,
           binds=(), stdio=(0, 1, 2), pty=False, winsize=None, status_fd=None, attach=None)
    start(launch) -> Started(pid, pidfd, pty)   # returns once the job has exec'd; raises
                                                # LaunchError (CommandNotFound: exit 127)
    Started.wait() -> int (exit code, 128+N for signal N); .signal(sig); .kill(); .close()
    User(uid, gid, groups=()), Bind(source, target, read_only=True)
    resolve_user(spec, ctx, environ) -> User    # --user; the sudo user; never silently root
    job_environ(ctx, user, extra=None) -> dict  # /etc/environment + HOME + extra
    create_cgroup(ctx, name, cpus=None) -> list[Path]; remove_cgroup(ctx, name)
    cgroup_dirs(ctx, name) -> list[Path]; cgroup_adapter(ctx) -> Cgroups (stats, kill)
    systemd_attach(ctx) -> Callable[[int], None]  # Launch.attach for the systemd driver
    DEFAULT_CAPS, FORWARDED_SIGNALS, exit_code(wait_status)
    EnvContext.load(host, env) (runtime.context): env, root, mntns, netns, hostname, environ,
        cgroup (EnvCgroup: driver, parent, version, controllers), cpus, gpus, device_gids

Notes for callers: a bind's target must already exist in the (read-only) rootfs; stdio fds
the caller has closed become /dev/null; joining a cgroup costs one RCU grace period (~10 ms
here: cgroup_threadgroup_rwsem), paid by the caller while the launcher sets up its
namespaces; FORWARDED_SIGNALS reach the job's process itself (not its group), anything else
sent to the launcher (SIGKILL) ends it all.

Processes. `start` forks the *launcher* (a child of the caller, in the host's PID namespace):
it joins the environment's network namespace and its persistent mount namespace, unshares
mount, PID, UTS and IPC namespaces, makes every mount private, sets the hostname and bind-
mounts `binds`. Meanwhile the caller writes the launcher's pid into each of `cgroup_dirs` (or
calls `attach`, the systemd driver's scope) and then tells it to go on; the launcher unshares
its cgroup namespace (rooted at the launch's cgroup) and forks the *init*: PID 1 of the new PID
namespace, in the launch's cgroup from its first instruction. The init mounts /proc (and masks
its host-wide knobs), pivot_roots into the rootfs with the old root detached, opens the pseudo-
terminal, and forks the *job*: setsid (and the pty as controlling terminal), CPU affinity, the
capability bounding set, the user, PR_SET_NO_NEW_PRIVS, chdir, execve. The init forwards
FORWARDED_SIGNALS to the job, reaps everything, writes the job's raw wait status to `status_fd`
and exits with the job's exit code (128+N for signal N); so does the launcher, whose pid
`Started` holds. The launcher dies with the caller and the init with the launcher
(PR_SET_PDEATHSIG SIGKILL): when the init dies, the kernel kills every process of the PID
namespace. The caller must therefore call `start` from the thread that stays until the job ends
(the main thread).

Everything the children need is imported before the fork: after pivot_root the host's Python
library is no longer reachable.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import posixpath
import select
import signal
import struct
import time
from collections import namedtuple
from collections.abc import Callable, Sequence
from pathlib import Path

from envctl.caps import DEFAULT, NUMBERS
from envctl.errors import HostError, UsageError
from envctl.host.libc import libc
from envctl.record import Factory, Record
from envctl.runtime.context import DEFAULT_PATH, EnvContext, format_cpus
from envctl.text import ascii_digits

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~5 ms): see record.py
if TYPE_CHECKING:
    from typing import NoReturn

    from envctl.host.cgroups import Cgroups

# The default set a root job keeps, and every capability by name (envctl.caps: shared with
# the spec's runtime.capabilities).
DEFAULT_CAPS = DEFAULT
CAPS = NUMBERS
# What the init (and the launcher) pass on to the job; others go to them alone.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH)
# /proc and /sys files and directories a job may not change (bound read-only) or see
# (masked): the host-wide knobs and leaks that are not per-namespace, runc's and Docker's
# default lists (moby oci/defaults.go): RAPL energy counters (powercap: CVE-2020-8694), the
# host's interrupts per CPU, firmware tables, keys of every user, kernel timers.
PROC_READONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")
MASKED = ("proc/acpi", "proc/asound", "proc/interrupts", "proc/kcore", "proc/keys",
          "proc/latency_stats", "proc/timer_list", "proc/timer_stats", "proc/sched_debug",
          "proc/scsi", "sys/firmware", "sys/devices/virtual/powercap")
# A launch's user namespace maps uid and gid 0 to the environment's own host id (ctx.userns)
# and the job's own user and groups to themselves, nothing else (docs/security.md says why);
# the kernel takes at most this many lines in a map (user_namespaces(7), Linux >= 4.15).
USERNS_MAP_LINES = 340
# The one capability the init keeps once the job runs: signals to a job of another uid (it
# forwards SIGTERM & co.). Harmless outside: the init sees only its own PID namespace.
CAP_KILL = 5
# The launcher's (and init's) own exit status when something before the exec failed.
SETUP_FAILED = 125

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x20000000, 0x40000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CAP_VERSION_3 = 0x20080522
CLOSE_RANGE_CLOEXEC = 1 << 2
TIOCSCTTY, TIOCSWINSZ, TIOCSPTLCK, TIOCGPTPEER = 0x540E, 0x5414, 0x40045431, 0x5441
TTY_GID = 5  # the group of /dev/pts in every environment (envctl's /etc/group: tty)
DEVPTS_DATA = f"newinstance,ptmxmode=0666,mode=0620,gid={TTY_GID},max=1024".encode()
KEYCTL_JOIN_SESSION_KEYRING = 1
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capget": 125, "capset": 126, "close_range": 436,
                        "keyctl": 250},
             "aarch64": {"pivot_root": 41, "capget": 90, "capset": 91, "close_range": 436,
                         "keyctl": 219}}
_NR = _SYSCALLS.get(os.uname().machine, _SYSCALLS["x86_64"])


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


# ---------------------------------------------------------------- the API


class User(namedtuple("User", "uid gid groups", defaults=((),))):
    """Who the job runs as: uid, primary gid and supplementary groups (a tuple of ints)."""

    __slots__ = ()


class Bind(namedtuple("Bind", "source target read_only", defaults=(True,))):
    """A per-launch bind mount: host path `source` at `target` inside the rootfs (the target
    must exist in the tree: the tree is read-only, no mount point can be made), always
    nosuid,nodev, read-only unless `read_only` is False."""

    __slots__ = ()


class Launch(Record):
    """What to run in which environment, and how. See the module docstring."""

    ctx: EnvContext
    argv: list[str]  # argv[0] is looked up in environ's PATH inside the rootfs
    environ: dict[str, str]  # the job's whole environment (see job_environ)
    user: User
    cwd: str = "/"
    cpus: tuple[int, ...] | None = None  # CPU affinity: a subset of ctx.cpus (None: all)
    cgroup_dirs: list[Path] = Factory(list)  # the launcher joins each (cgroupfs)
    caps: tuple[str, ...] | None = None  # bounding set kept; None: DEFAULT_CAPS for uid 0
    binds: Sequence[Bind] = ()
    stdio: tuple[int, int, int] = (0, 1, 2)  # the job's stdin, stdout, stderr (without pty)
    pty: bool = False  # a new pseudo-terminal inside the environment; master in Started.pty
    winsize: tuple[int, int] | None = None  # (rows, columns) of the pty
    status_fd: int | None = None  # the init writes the job's raw wait status here, "N\n"
    # The caller's own descriptors that no process of the launch may hold (the other ends of
    # a relay's pipes: held there, the job's stdin would never end): the launcher closes them.
    keep_out: tuple[int, ...] = ()
    # Called in the caller with the launcher's pid before the launcher enters anything (the
    # systemd driver's scope: `systemd_attach`); the launcher waits for it.
    attach: Callable[[int], None] | None = None
    # Written to the launcher's /proc/self/oom_score_adj first thing, while it is still root
    # in the host's namespaces (None: inherited). A supervisor protects itself with -1000
    # (daemon.protect_from_oom) and gives its job 0 back: written with CAP_SYS_RESOURCE, that
    # also resets the floor the kernel lets an unprivileged process lower it to
    # (oom_score_adj_min, inherited with the -1000), so the job cannot take -1000 back.
    oom_score_adj: int | None = None


class Started(Record):
    """A launch whose job has exec'd: `pid` and `pidfd` are the launcher's (the caller's
    child, which exits with the job's exit code); `pty` the pseudo-terminal's master."""

    pid: int
    pidfd: int
    pty: int | None = None

    def signal(self, sig: int) -> None:
        """Send `sig` to the launcher, which passes FORWARDED_SIGNALS on to the job; SIGKILL
        ends the launcher and with it the whole PID namespace. Gone already is fine."""
        if self.pidfd < 0:
            return  # reaped (wait) or closed: nothing left to signal
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def wait(self) -> int:
        """Reap the launcher; the job's exit code (128+N when signal N ended it)."""
        _, status = os.waitpid(self.pid, 0)
        self.close()
        return exit_code(status)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class LaunchError(HostError):
    """Something before the job's exec failed: `step` names it ("setns net", "pivot_root",
    "exec"), `errno` is the kernel's answer (0 when there is none)."""

    def __init__(self, message: str, *, step: str, errno: int = 0, exit_code: int = 1):
        super().__init__(message)
        self.step = step
        self.errno = errno
        self.exit_code = exit_code


class CommandNotFound(LaunchError):
    """The program is not in the environment (exit 127, as a shell says it)."""


def exit_code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128+N for signal N."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


# ---------------------------------------------------------------- users and environment


def resolve_user(spec: str | None, ctx: EnvContext,
                 environ: dict[str, str] | os._Environ[str] = os.environ) -> User:
    """The user `--user spec` names ("name", "uid", "name:group", "uid:gid"), looked up in the
    rootfs's /etc/passwd and /etc/group, then the host's. Without `spec`: the user behind sudo
    ($SUDO_UID, $SUDO_GID). Never root unless asked for ("root" or "0"): UsageError.
    Supplementary groups: those of the rootfs's /etc/group listing the user, and the groups
    of the environment's GPU nodes (ctx.device_gids)."""
    if spec is None:
        uid = environ.get("SUDO_UID", "")
        if ascii_digits(uid) and int(uid) != 0:
            gid = environ.get("SUDO_GID", "")
            primary = int(gid) if ascii_digits(gid) else int(uid)
            return _outside_userns_block(
                User(int(uid), primary, tuple(g for g in ctx.device_gids if g != primary)),
                None, ctx)
        raise UsageError("envctl runs nothing as root unless asked: give --user USER (a name "
                         "or uid; --user root to run as root); run through sudo, the user "
                         "behind sudo is the default")
    return _outside_userns_block(_user_from(spec, ctx), spec, ctx)


def _outside_userns_block(user: User, spec: str | None, ctx: EnvContext) -> User:
    """`user`, unless one of its ids is in the environment's own block of host ids: the
    first is root inside (a job of that uid would map one host id twice, which the kernel
    refuses only at launch), the rest are reserved to the environment (UsageError)."""
    if not ctx.userns:
        return user
    first, last = ctx.userns, ctx.userns + max(ctx.userns_size, 1) - 1
    ids = [("uid", user.uid), ("gid", user.gid), *(("group", g) for g in user.groups)]
    for what, i in ids:
        if first <= i <= last:
            who = f"--user {spec!r}" if spec is not None else f"the sudo user ({user.uid})"
            raise UsageError(
                f"{who}: {what} {i} is one of the host ids of environment '{ctx.env}''s user "
                f"namespace ({first}-{last}; {first} is its root): give --user root for root "
                "inside, or a user and groups outside that range")
    return user


def _user_from(spec: str, ctx: EnvContext) -> User:
    """The User `--user spec` names (see resolve_user)."""
    name, _, group = spec.partition(":")
    if not name:
        raise UsageError(f"--user {spec!r}: give a user name or uid")
    passwd = _table(ctx.root / "etc" / "passwd")  # name:x:uid:gid:gecos:home:shell
    if ascii_digits(name):
        uid = int(name)
        entry = next((e for e in passwd.values() if e[2] == name), None)
    else:
        entry = passwd.get(name) or _host_user(name)
        if entry is None or not ascii_digits(entry[2]):
            raise UsageError(f"--user {spec!r}: no user '{name}' in the environment's "
                             "/etc/passwd nor on the host")
        uid = int(entry[2])
    login = entry[0] if entry else ""
    primary = int(entry[3]) if entry and ascii_digits(entry[3]) else uid
    groups = _table(ctx.root / "etc" / "group")  # name:x:gid:member,member
    gid = _group_id(group, groups, spec) if group else primary
    extra = {int(g[2]) for g in groups.values() if login and ascii_digits(g[2])
             and login in g[3].split(",")}
    return User(uid, gid, tuple(sorted((extra | set(ctx.device_gids)) - {gid})))


def _table(path: Path) -> dict[str, list[str]]:
    """name -> the fields of each line of a passwd or group file (missing file: empty)."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        raise HostError(f"read {path}: {exc.strerror}") from exc
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 4 and parts[0] and not parts[0].startswith("#"):
            out.setdefault(parts[0], parts)
    return out


def _host_user(name: str) -> list[str] | None:
    import pwd

    try:
        p = pwd.getpwnam(name)
    except KeyError:
        return None
    return [p.pw_name, "x", str(p.pw_uid), str(p.pw_gid), "", p.pw_dir, p.pw_shell]


def _group_id(group: str, groups: dict[str, list[str]], spec: str) -> int:
    if ascii_digits(group):
        return int(group)
    if group in groups and ascii_digits(groups[group][2]):
        return int(groups[group][2])
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(f"--user {spec!r}: no group '{group}' in the environment's "
                         "/etc/group nor on the host") from None


def job_environ(ctx: EnvContext, user: User, extra: dict[str, str] | None = None
                ) -> dict[str, str]:
    """The environment's variables (its /etc/environment), HOME (from the rootfs's passwd:
    /root for root, else / when the user has no entry there), then `extra`."""
    env = dict(ctx.environ)
    home = next((e[5] for e in _table(ctx.root / "etc" / "passwd").values()
                 if len(e) > 5 and e[2] == str(user.uid) and e[5]),
                "/root" if user.uid == 0 else "/")
    env.setdefault("HOME", home)
    env.update(extra or {})
    return env


# ---------------------------------------------------------------- per-launch cgroups


def cgroup_adapter(ctx: EnvContext) -> Cgroups:
    """The cgroupfs adapter for the environment's cgroup parent (stats, kill, …)."""
    from envctl.host.cgroups import Cgroups

    assert ctx.cgroup is not None
    return Cgroups.from_env().for_parent(ctx.cgroup.parent)


def cgroup_dirs(ctx: EnvContext, name: str) -> list[Path]:
    """The directories of the launch's cgroup `<parent>/<env>/<name>`, one per hierarchy of
    the environment's cgroup (cgroupfs driver), as Cgroups.dirs names them; [] without one.

    Found from mountinfo here rather than through envctl.host.cgroups, whose import (the
    host facts' dataclasses, the spec's unit parsers) costs ~15 ms of every `exec`."""
    cg = ctx.cgroup
    if cg is None or cg.driver != "cgroupfs":
        return []
    v1, unified = _cgroup_mounts()
    rel = Path(cg.parent_name, ctx.env, name)
    if cg.version == 2:
        return [Path(unified) / rel] if unified else []
    out: list[Path] = []
    for c in cg.controllers:
        if c in v1 and (d := Path(v1[c]) / rel) not in out:
            out.append(d)
    return out


def _cgroup_mounts() -> tuple[dict[str, str], str | None]:
    """v1 controller -> mount point, and the cgroup2 mount, at or below ENVCTL_CGROUP_ROOT (as
    envctl.host.cgroups.detect_layout finds them: the first mount of each, roots only)."""
    base = os.environ.get("ENVCTL_CGROUP_ROOT", "/sys/fs/cgroup").rstrip("/") or "/"
    v1: dict[str, str] = {}
    unified = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            tail = right.split()
            if not sep or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
                continue
            fields = left.split()
            mnt = fields[4].replace("\\040", " ")
            if fields[3] != "/" or not (mnt == base or mnt.startswith(base.rstrip("/") + "/")):
                continue
            if tail[0] == "cgroup2":
                unified = unified or mnt
            else:
                for opt in tail[2].split(","):
                    v1.setdefault(opt, mnt)
    return v1, unified


def final_status(started: Started, status_r: int, buf: bytes) -> int:
    """The job's raw wait status once its launcher has ended (a supervisor's poll loop saw the
    pidfd): what the init wrote to the status pipe (`buf`, plus what is left in it), or, when
    the init died without a word (the OOM killer chose it; SIGKILL), the launcher's exit 128+N
    read as signal N. Reaps the launcher and closes its pidfd and the pipe."""
    _, launcher_status = os.waitpid(started.pid, 0)
    started.close()
    os.set_blocking(status_r, False)
    with contextlib.suppress(OSError):  # EAGAIN: the init died without writing
        buf += os.read(status_r, 64)
    os.close(status_r)
    try:
        return int(buf.split()[0])
    except (IndexError, ValueError):
        code = os.waitstatus_to_exitcode(launcher_status)
        return code - 128 if code > 128 else launcher_status


def _delegate(env_dir: Path) -> None:
    """cgroup v2: a child has only the controllers its parent's cgroup.subtree_control enables,
    and an environment's cgroup (which holds no process of its own: every launch is in a child)
    enables none; without them a launch's child would have no memory.events (OOM kills), no
    memory.peak and no limits of its own. Enabled once, for what the environment has."""
    try:
        have = (env_dir / "cgroup.controllers").read_text().split()
        on = set((env_dir / "cgroup.subtree_control").read_text().split())
    except OSError:
        return
    want = [c for c in ("cpu", "cpuset", "memory", "io", "pids") if c in have and c not in on]
    if want:
        _write(env_dir / "cgroup.subtree_control", " ".join(f"+{c}" for c in want))


def create_cgroup(ctx: EnvContext, name: str, *, cpus: tuple[int, ...] | None = None,
                  mem: int = 0, devices: tuple[str, ...] | None = None) -> list[Path]:
    """Make the launch's cgroup `<env>/<name>` (cgroupfs driver) in each hierarchy of the
    environment's cgroup and return its directories (Launch.cgroup_dirs). A v1 cpuset child
    starts empty and takes no task: it gets `cpus` (default: the environment's cpuset) and the
    environment's memory nodes. `mem` (bytes; 0: none) is its own memory.max
    (memory.limit_in_bytes on v1); `devices` its own device allow-list (numbered rules; v1:
    devices.deny a, then one devices.allow each; None: the environment's applies), written
    before any task joins it. With the systemd driver, or no cgroup: [] (systemd_attach)."""
    if ctx.cgroup is None:
        # Never outside the environment's limits: a launch without a cgroup would run in the
        # caller's.
        raise HostError(f"environment '{ctx.env}' has no cgroup recorded; `envctl up "
                        f"{ctx.env}` makes it")
    dirs = cgroup_dirs(ctx, name)
    made: list[Path] = []
    mem_set = devices_set = False
    try:
        for d in dirs:
            if ctx.cgroup.version == 2:
                _delegate(d.parent)
            try:
                d.mkdir()
            except FileExistsError:
                pass  # EEXIST: a launch of the same name that died before removing it
            except FileNotFoundError:
                raise HostError(f"create cgroup '{ctx.env}/{name}': {d.parent} is gone: the "
                                f"environment's cgroup; `envctl up {ctx.env}` makes it "
                                "again") from None
            made.append(d)
            cpuset = d.parent / "cpuset.cpus"
            if ctx.cgroup and ctx.cgroup.version == 1 and cpuset.exists():
                _write(d / "cpuset.mems", (d.parent / "cpuset.mems").read_text().strip())
                _write(d / "cpuset.cpus", format_cpus(cpus) if cpus
                       else cpuset.read_text().strip())
            elif cpus and (d / "cpuset.cpus").exists():
                _write(d / "cpuset.cpus", format_cpus(cpus))  # v2, when delegated
            for limit in ("memory.max", "memory.limit_in_bytes"):
                if mem and (d / limit).exists():
                    _write(d / limit, str(mem))
                    mem_set = True
            if devices is not None and (d / "devices.deny").exists():
                # Deny all, then allow: at no moment more than both lists (no task is in it).
                _write(d / "devices.deny", "a")
                for rule in devices:
                    _write(d / "devices.allow", rule)
                devices_set = True
            elif devices is not None and ctx.cgroup.version == 2 and \
                    ctx.cgroup.driver == "cgroupfs":
                _attach_devices_v2(ctx, name, d, devices)
                devices_set = True
        cgroupfs = ctx.cgroup.driver == "cgroupfs"
        if cgroupfs and mem and not mem_set:
            raise HostError(f"create cgroup '{ctx.env}/{name}': no memory controller in the "
                            f"environment's cgroup to give it its own memory limit")
        if cgroupfs and devices is not None and not devices_set:
            raise HostError(f"create cgroup '{ctx.env}/{name}': no devices controller in the "
                            "environment's cgroup to give it its own device allow-list")
    except OSError as exc:
        _rmdirs(made)
        raise HostError(f"create cgroup '{ctx.env}/{name}': {exc.filename}: "
                        f"{exc.strerror}") from exc
    except BaseException:
        _rmdirs(made)
        raise
    return dirs


def _attach_devices_v2(ctx: EnvContext, name: str, d: Path, devices: tuple[str, ...]) -> None:
    """The launch's own device program on its (new, empty) v2 cgroup `d`: the kernel runs it
    and the environment's, and allows what both allow. It goes with the cgroup (rmdir)."""
    from envctl.host import bpf

    if not bpf.allows_children(d.parent):
        raise HostError(f"create cgroup '{ctx.env}/{name}': the environment's device program "
                        "was attached without BPF_F_ALLOW_MULTI (by an earlier envctl), which "
                        "lets no cgroup below it narrow its devices: `envctl up "
                        f"{ctx.env}` replaces it")
    bpf.attach_device_program(d, devices, name=f"{ctx.env}/{name}")


def remove_cgroup(ctx: EnvContext, name: str) -> None:
    """Remove the launch's cgroup; gone already is fine. Empty (the launch's PID namespace
    died with its init) it is one rmdir per hierarchy; a process still in it (a launch that
    could not be waited for) is killed first, by the cgroup adapter."""
    dirs = cgroup_dirs(ctx, name)
    if _rmdirs(dirs):
        return
    controllers = ctx.cgroup.controllers if ctx.cgroup else ()
    cgroup_adapter(ctx).remove(f"{ctx.env}/{name}", controllers or None)


def _rmdirs(dirs: list[Path]) -> bool:
    """rmdir each (and anything below it, deepest first); False when one stays busy."""
    deadline = time.monotonic() + 1.0
    for top in dirs:
        for d in [Path(p) for p, _, _ in os.walk(top, topdown=False)] or [top]:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break  # ENOENT: gone already
                except OSError as exc:
                    # EBUSY: a task is still there, or the kernel is still tearing the last
                    # one down (for a moment after its exit).
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        if exc.errno == errno.EBUSY:
                            return False
                        raise HostError(f"remove cgroup {d}: {exc.strerror}") from exc
                    time.sleep(0.005)
    return True


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())  # one write: cgroupfs parses each as one command
    finally:
        os.close(fd)


def _env_slice(ctx: EnvContext) -> tuple[str, str] | None:
    """The environment's slice and its cgroup (relative to the hierarchy's root) for the
    systemd driver; None for the cgroupfs driver."""
    if ctx.cgroup is None or ctx.cgroup.driver != "systemd":
        return None
    from envctl.spec.naming import env_slice, slice_cgroup

    parent = ctx.cgroup.parent_name
    return env_slice(ctx.env, parent), slice_cgroup(ctx.env, parent)


def systemd_attach(ctx: EnvContext, *, mem: int = 0, devices: Sequence[str] | None = None,
                   cpus: Sequence[int] = (), proc: Path = Path("/proc")
                   ) -> Callable[[int], None] | None:
    """For the systemd driver: Launch.attach putting the launcher into a transient scope of
    the environment's slice (systemd owns that tree: envctl writes none of it); the scope
    goes when its processes have. `mem` (bytes; 0: none) is the scope's MemoryMax= (systemd
    writes memory.max, or memory.limit_in_bytes on v1). `devices` (numbered rules, as
    create_cgroup's; None: the slice's apply) become the scope's DevicePolicy=closed and one
    DeviceAllow= each: systemd gives the scope its own list below the slice's, which the
    kernel applies as well (so it only narrows). `cpus`, on cgroup v2, the scope's
    AllowedCPUs= (its own cpuset.cpus; v1 has no cpuset for systemd to write: affinity only).
    None for the cgroupfs driver."""
    where = _env_slice(ctx)
    if where is None:
        return None
    from envctl.host.scope import ScopeError, attach_scope

    unit, cgroup = where
    v1, _ = _cgroup_mounts()
    props: list[tuple[str, ...]] = [("MemoryMax", "t", str(mem))] if mem else []
    if devices is not None:
        props += _scope_devices(devices, proc)
    if cpus and ctx.cgroup is not None and ctx.cgroup.version == 2:
        props.append(("AllowedCPUs", "ay", *_cpu_mask(cpus)))

    def attach(pid: int) -> None:
        try:
            attach_scope(unit, cgroup, pid, v1_mounts=v1, properties=props)
        except ScopeError as exc:
            raise HostError(f"attach to slice '{unit}': {exc}") from None
    return attach


def _scope_devices(devices: Sequence[str], proc: Path) -> list[tuple[str, ...]]:
    """DevicePolicy= and DeviceAllow= (D-Bus a(ss)) of a scope allowing `devices`, spelled as
    the environment's slice spells them (envctl.host.systemd.device_allow). That module costs
    ~20 ms to import: only a launch with a list of its own pays it."""
    from envctl.host.systemd import device_allow, read_proc_devices

    names = read_proc_devices(proc)
    pairs = [device_allow(rule, names).split() for rule in devices]
    return [("DevicePolicy", "s", "closed"),
            ("DeviceAllow", "a(ss)", str(len(pairs)), *(w for pair in pairs for w in pair))]


def _cpu_mask(cpus: Sequence[int]) -> list[str]:
    """A CPU set as D-Bus `ay` words for busctl: the byte count, then each byte of the bitmask
    (CPU n is bit n % 8 of byte n // 8), as systemd's AllowedCPUs= takes it."""
    mask = bytearray(max(cpus) // 8 + 1)
    for c in cpus:
        mask[c // 8] |= 1 << (c % 8)
    return [str(len(mask)), *(str(b) for b in mask)]


def supervisor_scope(ctx: EnvContext, what: str) -> Callable[[], str] | None:
    """For the systemd driver: start moving this process (a job's or the service's detached
    supervisor) into a transient scope of its own in the environment's slice,
    `<slice>-<what>-<pid>.scope`, and return what waits for it to be done (the scope's name;
    HostError when systemd refused). Out of the cgroup of whatever ran envctl — an SSH
    session's scope, a oneshot unit's, a timer's service — the supervisor no longer goes when
    systemd stops that unit (at logout with KillUserProcesses=yes, when a oneshot exits), as
    podman gives conmon a scope of its own. Its own scope, not the job's: killing the job's
    scope must not kill its supervisor. The caller goes on meanwhile (the launch). None for
    the cgroupfs driver, which never talks to systemd."""
    where = _env_slice(ctx)
    if where is None:
        return None
    from envctl.host.scope import ScopeError, begin_scope

    unit, cgroup = where
    pid = os.getpid()
    scope = f"{unit.removesuffix('.slice')}-{what}-{pid}.scope"
    try:
        call = begin_scope(unit, cgroup, pid, scope, v1_mounts=_cgroup_mounts()[0])
    except ScopeError as exc:
        raise HostError(f"supervisor scope in slice '{unit}': {exc}") from None

    def done() -> str:
        try:
            return call.finish()
        except ScopeError as exc:
            raise HostError(f"supervisor scope in slice '{unit}': {exc}") from None
    return done


# ---------------------------------------------------------------- start


class _Plan(Record):
    """Everything the children use, computed and opened before the fork."""

    parent: int
    netns_fd: int
    mntns_fd: int
    err_w: int
    sync_r: int  # the launcher's end of the go-ahead pipe (-1: no cgroup to join)
    sync_w: int  # the caller's end, which the launcher closes
    sock: int  # the children's end of the pty socket pair
    cpus: tuple[int, ...]
    keep: int  # capability bits kept
    last_cap: int
    argv: list[bytes]
    environ: dict[bytes, bytes]
    hostname: bytes
    binds: list[Bind]
    # Installs the launch's seccomp filter in the calling process (envctl.runtime.seccomp,
    # compiled and prepared before the fork); None: unconfined.
    seccomp: Callable[[], None] | None = None
    # The size of each per-launch tmpfs (/tmp, /dev/shm) as a share of the environment's
    # memory limit, in bytes; 0: as large as the environment's own (the spec's) allows.
    tmpfs_cap: int = 0
    # The host uid/gid root inside is (the environment's user namespace); 0: none, the job's
    # ids are the host's (runtime.userns: false).
    userns: int = 0
    # The init <-> job handshake (see _init): the job's ends, then the init's. -1: unused.
    go_r: int = -1
    ready_w: int = -1
    go_w: int = -1
    ready_r: int = -1


def start(launch: Launch, *, init: Callable[[Launch, _Plan, int], NoReturn] | None = None
          ) -> Started:
    """Start the launch and return once its job has exec'd (see the module docstring).

    UsageError for a launch that cannot be right (empty argv, a NUL byte, unknown
    capabilities, CPUs outside the environment's); LaunchError naming the step that failed,
    CommandNotFound (exit 127) when argv[0] is not in the environment, exit 126 when it cannot
    be run. `init` replaces the init the launcher forks (envctl.runtime.gvisor's runs runsc);
    an environment with `isolation: gvisor` is started through envctl.runtime.gvisor."""
    if init is None and launch.ctx.isolation == "gvisor":
        import sys

        from envctl.runtime import gvisor

        return gvisor.start(launch, sys.modules[__name__])  # reuses this module's steps
    ctx = launch.ctx
    plan_args = _check(launch)
    fds: list[int] = []
    try:
        netns_fd = _open_ns(ctx.netns, "network namespace", fds) if ctx.netns else -1
        mntns_fd = _open_ns(ctx.mntns, "mount namespace", fds)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        fds += [err_r, err_w]
        sync_r = sync_w = -1
        if launch.attach is not None or launch.cgroup_dirs:
            sync_r, sync_w = os.pipe2(os.O_CLOEXEC)
            fds += [sync_r, sync_w]
        mine = theirs = -1
        if launch.pty:
            import socket

            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            mine, theirs = a.detach(), b.detach()
            fds += [mine, theirs]
        if launch.binds:
            from envctl.host import mounts  # noqa: F401 - for the launcher, before the fork
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        fds += [go_r, go_w, ready_r, ready_w]
        plan = _Plan(os.getpid(), netns_fd, mntns_fd, err_w, sync_r, sync_w, theirs,
                     go_r=go_r, ready_w=ready_w, go_w=go_w, ready_r=ready_r, **plan_args)
        with _signals_blocked():
            pid = os.fork()
            if pid == 0:
                _launcher(launch, plan, init)  # never returns
        if sync_r >= 0:  # the launcher's end: closed here, a launcher that died is EPIPE
            os.close(sync_r)
            fds.remove(sync_r)
        if theirs >= 0:  # the children's end: ours open would hide their exit from recv_fds
            os.close(theirs)
            fds.remove(theirs)
        for fd in (go_r, go_w, ready_r, ready_w):  # the init's and the job's: ours open, a
            os.close(fd)  # job that died before its "u" would leave the init waiting forever
            fds.remove(fd)
        return _started(launch, pid, err_r, err_w, sync_w, mine, fds)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _check(launch: Launch) -> dict:
    ctx = launch.ctx
    if not launch.argv or not all(isinstance(a, str) for a in launch.argv):
        raise UsageError("give the command to run, as a list of arguments")
    if not launch.argv[0]:
        raise UsageError("the command to run is an empty string")
    for i, arg in enumerate(launch.argv):
        if "\0" in arg:
            raise UsageError(f"argument {i} contains a NUL byte, which no program can receive")
    for key, value in launch.environ.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise UsageError(f"environment variable {key!r}: a name without '=' or NUL, and "
                             "a value without NUL")
    if not launch.cwd.startswith("/"):
        raise UsageError(f"working directory {launch.cwd!r}: an absolute path in the "
                         "environment")
    # Root keeps the spec's set (runtime.capabilities, recorded in the journal) or the
    # default; any other user keeps none, whatever the spec says.
    caps = launch.caps if launch.caps is not None else (
        (launch.ctx.caps if launch.ctx.caps is not None else DEFAULT_CAPS)
        if launch.user.uid == 0 else ())
    unknown = sorted(c for c in caps if c.upper().removeprefix("CAP_") not in CAPS)
    if unknown:
        raise UsageError(f"unknown capabilities {', '.join(unknown)}; known: "
                         f"{', '.join(CAPS)}")
    keep = 0
    for c in caps:
        keep |= 1 << CAPS[c.upper().removeprefix("CAP_")]
    cpus = tuple(launch.cpus) if launch.cpus is not None else ctx.cpus
    outside = sorted(set(cpus) - set(ctx.cpus)) if ctx.cpus else []
    if outside or not cpus:
        raise UsageError(f"CPUs {outside or '(none)'}: the environment '{ctx.env}' runs on "
                         f"CPUs {','.join(map(str, ctx.cpus))}")
    if ctx.userns and len(mapped_gids(launch.user) - {0}) >= USERNS_MAP_LINES:
        raise UsageError(f"user {launch.user.uid}: {len(launch.user.groups)} groups; a user "
                         f"namespace of '{ctx.env}' maps at most {USERNS_MAP_LINES - 1}")
    for b in launch.binds:
        if not b.target.startswith("/") or any(p in (".", "..") for p in b.target.split("/")):
            raise UsageError(f"bind target {b.target!r}: an absolute path without . or ..")
    try:
        last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last_cap = max(CAPS.values())
    return {"cpus": cpus, "keep": keep, "last_cap": last_cap,
            "argv": [os.fsencode(a) for a in launch.argv],
            "environ": {os.fsencode(k): os.fsencode(v) for k, v in launch.environ.items()},
            "hostname": ctx.hostname.encode(), "binds": list(launch.binds),
            "seccomp": _seccomp(ctx, keep), "tmpfs_cap": ctx.memory_max // 2,
            "userns": ctx.userns}


def _seccomp(ctx: EnvContext, keep: int) -> Callable[[], None] | None:
    """The launch's seccomp filter, ready to install: the environment's profile (the spec's
    runtime.seccomp) for the capabilities the job keeps, compiled once per profile and set of
    capabilities and cached in the environment's run directory, <run>/<env>/seccomp, which
    `down` removes (envctl.runtime.seccomp)."""
    if ctx.seccomp == "unconfined":
        return None
    from envctl.runtime import seccomp

    try:
        prog = seccomp.compile(ctx.seccomp, keep, nested_userns=ctx.nested_userns,
                               cache_dir=ctx.mntns.parent.parent / ctx.env / "seccomp")
    except OSError as exc:  # the cache directory (the profile's own errors are InputError)
        raise HostError(f"seccomp profile of '{ctx.env}': {exc.filename or ctx.seccomp}: "
                        f"{exc.strerror}") from exc
    return seccomp.prepare(prog) if prog is not None else None


def _open_ns(path: Path, what: str, fds: list[int]) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise HostError(f"enter {what} {path}: {exc.strerror}") from exc
    fds.append(fd)
    return fd


@contextlib.contextmanager
def _signals_blocked():  # noqa: ANN202 - a context manager
    """FORWARDED_SIGNALS blocked across a fork: each child installs its own handlers before
    it takes a signal, and the caller's handlers never run in a child."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _started(launch: Launch, pid: int, err_r: int, err_w: int, sync_w: int, mine: int,
             fds: list[int]) -> Started:
    """The caller's side after the fork: attach, take the pty, wait for the exec."""
    os.close(err_w)
    fds.remove(err_w)
    try:
        started = Started(pid, os.pidfd_open(pid))
    except OSError:  # EMFILE: the launcher must not wait for a go-ahead that never comes
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    try:
        if sync_w >= 0:
            _join(launch, pid, err_r)
            with contextlib.suppress(BrokenPipeError):  # it failed meanwhile: its report says
                os.write(sync_w, b"g")
        if launch.pty:
            import socket

            with socket.socket(fileno=os.dup(mine)) as s:
                _, got, _, _ = socket.recv_fds(s, 16, 1)
            started.pty = got[0] if got else None
        report = _read_all(err_r)
        if report:
            os.waitpid(pid, 0)
            started.close()
            if started.pty is not None:
                os.close(started.pty)
            raise _error(launch, report)
        return started
    except BaseException:
        if started.pidfd >= 0:  # not reaped yet
            started.kill()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            started.close()
        raise


def _join(launch: Launch, pid: int, err_r: int) -> None:
    """Put the launcher into the launch's cgroup (its directories, or the systemd driver's
    attach) while it sets up its namespaces: a migration waits for an RCU grace period
    (~10 ms on cgroup v1 here), and systemd for a D-Bus round trip. The launcher forks the
    namespace's init, which inherits the cgroup, only once this is done. A launcher that
    failed meanwhile is a zombie: a cgroup.procs write of its pid is accepted and moves
    nothing (its report is read next, by the caller), and the scope's attach sees it end. When
    the join fails, the launcher is killed, and its own error is reported if it wrote one."""
    step = "join cgroup"
    try:
        me = str(pid).encode()
        for d in launch.cgroup_dirs:
            fd = os.open(d / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, me)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(d)) from None
            finally:
                os.close(fd)
        if launch.attach is not None:
            step = "attach"
            launch.attach(pid)
    except (OSError, HostError) as exc:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        report = _read_all(err_r)  # the launcher's own failure, if it had one
        if report or isinstance(exc, HostError):
            raise _error(launch, report) if report else exc from None
        raise _error(launch, f"{step}\0{exc.errno or 0}\0{exc.filename or ''}".encode()
                     ) from None


def _read_all(fd: int) -> bytes:
    out = b""
    while chunk := os.read(fd, 4096):
        out += chunk
    return out


def _error(launch: Launch, report: bytes) -> LaunchError:
    step, _, rest = report.decode(errors="replace").partition("\0")
    num, _, detail = rest.partition("\0")
    no = int(num) if num.isdigit() else 0
    env = launch.ctx.env
    prog = launch.argv[0]
    if step == "exec":
        if no in (errno.ENOENT, errno.ENOTDIR):
            where = "no such file in" if "/" in prog else "command not found in"
            return CommandNotFound(f"{prog}: {where} environment '{env}'"
                                   + ("" if "/" in prog else
                                      f" (PATH={launch.environ.get('PATH', DEFAULT_PATH)})"),
                                   step=step, errno=no, exit_code=127)
        return LaunchError(f"{prog}: cannot run it in environment '{env}': "
                           f"{os.strerror(no) if no else detail}", step=step, errno=no,
                           exit_code=126)
    cause = os.strerror(no) if no else detail
    if no and detail:
        cause = f"{detail}: {cause}"
    return LaunchError(f"enter environment '{env}': {step}: {cause}", step=step, errno=no)


# ---------------------------------------------------------------- the children


def _fail(err_w: int, step: str, exc: BaseException) -> NoReturn:
    """Report the step that failed to the caller and end this process."""
    if isinstance(exc, OSError):
        no, detail = exc.errno or 0, str(exc.filename or "")
    else:
        no, detail = 0, f"{type(exc).__name__}: {exc}"
    with contextlib.suppress(BaseException):
        os.write(err_w, f"{step}\0{no}\0{detail}".encode(errors="replace")[:4000])
    os._exit(SETUP_FAILED)


def _check_call(ret: int, what: str = "") -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what or None)


def _forward_to(target: list[int]):  # noqa: ANN202 - a signal handler
    def handler(sig: int, frame: object) -> None:
        if target[0] > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target[0], sig)
    return handler


def _launcher(launch: Launch, plan: _Plan,
              init_main: Callable[[Launch, _Plan, int], NoReturn] | None = None) -> NoReturn:
    """The caller's child, in the host's PID namespace (see the module docstring)."""
    step = "start"
    try:
        if plan.sync_w >= 0:
            os.close(plan.sync_w)  # EOF on sync_r, then, when the caller gives up or dies
        for fd in launch.keep_out:
            os.close(fd)
        os.setsid()  # out of the caller's terminal group: signals reach the job once, forwarded
        _check_call(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        if os.getppid() != plan.parent:
            os._exit(SETUP_FAILED)  # the caller died before the prctl
        if launch.oom_score_adj is not None:
            # The host's /proc: not setns yet. EACCES (no CAP_SYS_RESOURCE, below a floor the
            # caller was given): the inherited value stays, the supervisor had it too.
            with contextlib.suppress(PermissionError), open("/proc/self/oom_score_adj",
                                                            "w") as f:
                f.write(str(launch.oom_score_adj))
        signal.set_wakeup_fd(-1)
        init = [0]
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, _forward_to(init))
        if plan.netns_fd >= 0:
            step = "setns net"
            _check_call(libc.setns(plan.netns_fd, CLONE_NEWNET), str(launch.ctx.netns))
        step = "setns mnt"
        _check_call(libc.setns(plan.mntns_fd, CLONE_NEWNS), str(launch.ctx.mntns))
        step = "unshare"
        _check_call(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWUTS | CLONE_NEWIPC))
        step = "make / private"
        _check_call(libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None))
        step = "sethostname"
        _check_call(libc.sethostname(plan.hostname, len(plan.hostname)))
        for b in plan.binds:
            step = f"bind {b.target}"
            _bind(launch.ctx.root, b)
        step = "per-launch mounts"
        _launch_mounts(launch.ctx.root, plan.tmpfs_cap)
        if plan.sync_r >= 0:
            # The caller has put this process into the launch's cgroup meanwhile (_join):
            # the init forked next inherits it.
            step = "join cgroup"
            if os.read(plan.sync_r, 1) != b"g":
                os._exit(SETUP_FAILED)  # the caller gave up (its own error says why)
        step = "unshare cgroup"  # rooted at the launch's cgroup: after the join
        _check_call(libc.unshare(CLONE_NEWCGROUP))
        step = "fork init"
        alive_r, alive_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            os.close(alive_w)
            (init_main or _init)(launch, plan, alive_r)  # never returns
        init[0] = pid
        for fd in (plan.err_w, plan.sock, alive_r, plan.netns_fd, plan.mntns_fd, plan.sync_r,
                   plan.go_r, plan.go_w, plan.ready_r, plan.ready_w):
            if fd >= 0:
                os.close(fd)
        if launch.status_fd is not None:
            os.close(launch.status_fd)
    except BaseException as exc:
        _fail(plan.err_w, step, exc)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        _, status = os.waitpid(pid, 0)
        os._exit(exit_code(status))
    finally:
        os._exit(SETUP_FAILED)


def _bind(root: Path, b: Bind) -> None:
    """Bind host path b.source at b.target beneath the rootfs, nosuid,nodev(,ro)."""
    import stat

    from envctl.host import mounts as m

    src = os.open(b.source, os.O_PATH | os.O_CLOEXEC)
    try:
        is_dir = stat.S_ISDIR(os.fstat(src).st_mode)
        with m.open_mountpoint(str(root), b.target, file=not is_dir) as mp:
            flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if b.read_only else 0)
            m.mount_on(mp, "bind", source_fd=src, flags=flags)
    finally:
        os.close(src)


def _launch_mounts(root: Path, tmpfs_cap: int) -> None:
    """The mounts of this launch alone, over the environment's shared ones (cwd anywhere):
    - /dev read-only: its nodes are what the environment's /dev holds, and no launch can
      swap one (a root job replacing /dev/null with a file or a symlink) for the next;
    - a devpts instance of its own at /dev/pts (/dev/ptmx links to its ptmx);
    - a /tmp and a /dev/shm of its own (tmpfs, mode 1777, nosuid,nodev), as Slurm's
      namespace/tmpfs gives each job: nothing one job leaves there reaches another, their
      pages are charged to this launch's cgroup, and they go with its mount namespace. Each
      is as large as the environment's own (the spec's shm_size; /tmp unsized), at most
      `tmpfs_cap` bytes (half the environment's memory limit) when that is set.
    The rootfs is read-only and host-owned, and /dev read-only in every launch: the mount
    points are opened beneath the root through no symlink, and mounted on by descriptor."""
    from envctl.host.safepath import fd_path, open_beneath

    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dev = open_beneath(root_fd, "dev", symlinks=False)
        try:
            _check_call(libc.mount(None, fd_path(dev).encode(), None, ctypes.c_ulong(
                MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC), None), "/dev")
        finally:
            os.close(dev)
        # A devpts instance of its own: the environment's is shared by every launch, and a
        # root job could read another user's terminal there (its DAC_OVERRIDE reaches every
        # uid of its namespace). At most DEVPTS_MAX terminals, each launch's own.
        pts = open_beneath(root_fd, "dev/pts", symlinks=False)
        try:
            _check_call(libc.mount(b"devpts", fd_path(pts).encode(), b"devpts", ctypes.c_ulong(
                MS_NOSUID | MS_NOEXEC), DEVPTS_DATA), "/dev/pts")
        finally:
            os.close(pts)
        for target in ("tmp", "dev/shm"):
            fd = open_beneath(root_fd, target, symlinks=False)
            try:
                st = os.fstatvfs(fd)
                size = st.f_blocks * st.f_frsize
                if tmpfs_cap and (not size or size > tmpfs_cap):
                    size = tmpfs_cap
                data = "mode=1777" + (f",size={size}" if size else "")
                _check_call(libc.mount(b"tmpfs", fd_path(fd).encode(), b"tmpfs", ctypes.c_ulong(
                    MS_NOSUID | MS_NODEV), data.encode()), f"/{target}")
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)


def _init(launch: Launch, plan: _Plan, alive_r: int) -> NoReturn:
    """PID 1 of the launch's PID namespace (see the module docstring)."""
    step = "init"
    try:
        _check_call(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
        # The launcher holds the other end open for as long as it lives: EOF means it died
        # before the prctl took effect, and nobody would ever kill this namespace.
        if select.select([alive_r], [], [], 0)[0]:
            os._exit(SETUP_FAILED)
        os.close(alive_r)
        # The host's namespaces (the environment's mount namespace still shows the host's /)
        # and the go-ahead pipe: the launcher's, never the init's.
        for fd in (plan.netns_fd, plan.mntns_fd, plan.sync_r):
            if fd >= 0:
                os.close(fd)
        # The host's /dev/null, opened before pivot_root, for the masks: never the rootfs's
        # /dev/null, which a job may have made a symlink to a host file.
        null = os.open("/dev/null", os.O_PATH | os.O_CLOEXEC)
        job = [0]
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, _forward_to(job))
        step = "chdir rootfs"
        os.chdir(launch.ctx.root)
        step = "mount /proc"
        _check_call(libc.mount(b"proc", b"proc", b"proc",
                               ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None), "proc")
        step = "mask /proc and /sys"
        _mask(null)
        os.close(null)
        step = "pivot_root"
        _check_call(_pivot_root(b".", b"."), str(launch.ctx.root))
        step = "detach the old root"
        _check_call(libc.umount2(b".", MNT_DETACH))
        os.chdir("/")
        slave = -1
        if launch.pty:
            step = "open a pseudo-terminal"
            slave = _open_pty(launch, plan)
        step = "fork the job"
        pid = os.fork()
        if pid == 0:
            _job(launch, plan, slave)  # never returns
        job[0] = pid
        for fd in (plan.err_w, slave, plan.sock, plan.go_r, plan.ready_w):
            if fd >= 0:
                os.close(fd)
        # The job waits for the go-ahead before it changes user, and so before any program
        # of the environment runs: by then the init has written the job's user namespace
        # maps (only a process of the host's user namespace may) and has confined itself,
        # so that no job ever sees a privileged init, however fast it is.
        if plan.userns:
            step = "user namespace"
            if os.read(plan.ready_r, 1) != b"u":
                os._exit(SETUP_FAILED)  # the job failed before (its own report says why)
            _write_id_maps(pid, plan.userns, launch.user)
        os.close(plan.ready_r)
        step = "confine the init"
        _confine_init(launch, plan)
        os.write(plan.go_w, b"g")
        os.close(plan.go_w)
    except BaseException as exc:
        _fail(plan.err_w, step, exc)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        while True:  # reap everything; the job's end ends the namespace
            try:
                got, status = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(SETUP_FAILED)
            if got == pid:
                break
        if launch.status_fd is not None:
            with contextlib.suppress(OSError):
                os.write(launch.status_fd, f"{status}\n".encode())
        os._exit(exit_code(status))
    finally:
        os._exit(SETUP_FAILED)


def _pivot_root(new: bytes, old: bytes) -> int:
    return libc.syscall(_NR["pivot_root"], new, old)


def _mask(null: int) -> None:
    """/proc's host-wide knobs read-only, the host-wide leaks of /proc and /sys hidden (cwd:
    the rootfs, with the launch's /proc mounted). Every target is opened beneath the rootfs
    through no symlink (they are in the kernel's own procfs and sysfs, but a path is never
    trusted), and every mount is made on that descriptor: a masked file gets the host's
    /dev/null (`null`, opened by the init before pivot_root), read-only; a masked directory an
    empty read-only tmpfs."""
    from envctl.host.safepath import fd_path, open_beneath

    ro = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
    root = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in PROC_READONLY:
            _bind_ro(root, f"proc/{name}", -1, ro)
        for name in MASKED:
            try:
                fd = open_beneath(root, name, os.O_PATH, symlinks=False)
            except FileNotFoundError:
                continue  # ENOENT: not on this kernel (no ACPI, no powercap): nothing to hide
            try:
                if os.path.isdir(fd_path(fd)):
                    _check_call(libc.mount(b"tmpfs", fd_path(fd).encode(), b"tmpfs",
                                           ctypes.c_ulong(ro), b"size=0,nr_inodes=1"), name)
                    continue
            finally:
                os.close(fd)
            _bind_ro(root, name, null, ro & ~MS_NODEV)  # a device node: nodev would refuse it
    finally:
        os.close(root)


def _bind_ro(root: int, name: str, source: int, flags: int) -> None:
    """Bind `source` (a descriptor; -1: the target itself) over `name` beneath `root`, then
    make the new mount read-only (a bind takes its flags from a remount, which must name the
    new mount: the target is opened again once it is there)."""
    from envctl.host.safepath import fd_path, open_beneath

    try:
        fd = open_beneath(root, name, os.O_PATH, symlinks=False)
    except FileNotFoundError:
        return  # ENOENT: not on this kernel
    try:
        _check_call(libc.mount(fd_path(source if source >= 0 else fd).encode(),
                               fd_path(fd).encode(), None, ctypes.c_ulong(MS_BIND | MS_REC),
                               None), name)
    finally:
        os.close(fd)
    fd = open_beneath(root, name, os.O_PATH, symlinks=False)
    try:
        _check_call(libc.mount(None, fd_path(fd).encode(), None, ctypes.c_ulong(
            MS_BIND | MS_REMOUNT | flags), None), name)
    finally:
        os.close(fd)


def _confine_init(launch: Launch, plan: _Plan) -> None:
    """Once the job is forked, the init keeps nothing a job could use through it (ptrace with
    a spec's SYS_PTRACE, or /proc/1): no descriptor but the status pipe, no capability but
    CAP_KILL (forwarding signals to a job of another uid), not dumpable (/proc/1/environ,
    /proc/1/fd, /proc/1/exe: root's alone), the job's seccomp filter, and neither the host's
    command line nor the caller's environment in its memory."""
    # Its stdin, stdout and stderr too: the caller's (an operator's terminal), the job's
    # business alone. Nothing but the status pipe (and the go-ahead, written next) stays.
    low = 0
    for keep in sorted(fd for fd in (launch.status_fd, plan.go_w) if fd is not None):
        if keep > low:
            _check_call(libc.syscall(_NR["close_range"], low, keep - 1, 0))
        low = keep + 1
    _check_call(libc.syscall(_NR["close_range"], low, ctypes.c_uint(0xFFFFFFFF), 0))
    _scrub_memory()
    _check_call(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0))
    for cap in range(plan.last_cap + 1):
        if cap != CAP_KILL:
            _check_call(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0))
    _capset(1 << CAP_KILL)
    _check_call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    if plan.seccomp is not None:
        plan.seccomp()


def id_maps(base: int, user: User) -> tuple[bytes, bytes]:
    """The uid_map and gid_map of a launch's user namespace: 0 -> `base`, the environment's
    own host id, and the job's own user (and its groups) -> themselves, nothing else. Root
    inside owns nothing of the host's root, a job of alice is alice on the host (her results
    on a data mount are hers), and no host id but hers can be reached from inside: root
    inside can neither become nor chown to a host user, even on a descriptor of a host file
    (an --output file, the caller's terminal) whose ids would otherwise be mapped."""
    def lines(ids: set[int]) -> bytes:
        return "".join(f"{i} {base if i == 0 else i} 1\n" for i in sorted(ids | {0})).encode()

    return lines({user.uid}), lines(mapped_gids(user))


def mapped_gids(user: User) -> set[int]:
    """The gids a launch's user namespace maps besides 0: a user's own primary and
    supplementary groups are its identity (alice's results are alice's groups' on the host).
    A root job's supplementary groups (its GPU nodes' group, /etc/group memberships) are not
    mapped: it holds them as host gids set before the unshare (_job), unmapped inside (shown
    as the overflow gid), which opens the nodes, while root inside, owner of every file it
    makes, could otherwise chgrp one to a host group and make it set-gid: a host user who ran
    it would be in that group."""
    return {user.gid} if user.uid == 0 else {user.gid, *user.groups}


def _write_id_maps(pid: int, base: int, user: User) -> None:
    """Write the job's user namespace maps (it has just unshared it): see id_maps."""
    for name, data in zip(("uid_map", "gid_map"), id_maps(base, user), strict=True):
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, data)  # one write: the kernel takes a map whole, once
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, f"/proc/{pid}/{name}") from None
        finally:
            os.close(fd)


def _scrub_memory() -> None:
    """Overwrite the command line and the environment the host gave this process (what
    /proc/1/cmdline shows to anyone, and /proc/1/environ to root): the init is a fork of the
    caller, whose environment may hold an operator's secrets."""
    os.environ.clear()
    with open("/proc/self/stat", "rb") as f:  # the launch's /proc: this process
        fields = f.read().rpartition(b")")[2].split()
    # proc(5): arg_start, arg_end, env_start, env_end are fields 48-51 (fields[0] is field 3).
    arg_start, arg_end, env_start, env_end = (int(fields[n - 3]) for n in (48, 49, 50, 51))
    if env_end > env_start:
        ctypes.memset(env_start, 0, env_end - env_start)
    if arg_end > arg_start:
        ctypes.memset(arg_start, 0, arg_end - arg_start)
        name = b"envctl-init"[:arg_end - arg_start - 1]
        ctypes.memmove(arg_start, name, len(name))


def _open_pty(launch: Launch, plan: _Plan) -> int:
    """A new pseudo-terminal in the environment's devpts: the master goes to the caller over
    the socket, the slave (owned by the job's user) is returned."""
    import socket

    master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY)
        # The job's own, as the host sees it (root inside: the user namespace's root).
        os.fchown(slave, plan.userns if plan.userns and launch.user.uid == 0
                  else launch.user.uid, TTY_GID)
        if launch.winsize:
            rows, cols = launch.winsize
            fcntl.ioctl(master, TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        with socket.socket(fileno=os.dup(plan.sock)) as s:
            socket.send_fds(s, [b"m"], [master])
        return slave
    finally:
        os.close(master)


def _job(launch: Launch, plan: _Plan, slave: int) -> NoReturn:
    """The job: its session, CPUs, capabilities, user, no_new_privs, then the exec."""
    step = "setsid"
    try:
        for fd in (plan.go_w, plan.ready_r):  # the init's ends: EOF when it dies
            if fd >= 0:
                os.close(fd)
        for sig in (*FORWARDED_SIGNALS, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE; exec keeps ignores
        os.setsid()
        stdio = launch.stdio
        if slave >= 0:
            step = "set the controlling terminal"
            fcntl.ioctl(slave, TIOCSCTTY, 0)
            stdio = (slave, slave, slave)
        step = "set up stdin/stdout/stderr"
        copies = [_dup_or_null(fd) for fd in stdio]  # dup first: the three may overlap 0..2
        for target, fd in enumerate(copies):
            os.dup2(fd, target, inheritable=True)
            os.close(fd)
        step = "close inherited descriptors"
        # Everything above stderr closes at the exec; the error pipe stays open until then.
        _check_call(libc.syscall(_NR["close_range"], 3, ctypes.c_uint(0xFFFFFFFF),
                                 CLOSE_RANGE_CLOEXEC))
        os.umask(0o022)
        step = "set CPU affinity"
        os.sched_setaffinity(0, plan.cpus)
        # The user namespace first: a new one starts with every capability in its bounding
        # set, which is dropped next.
        if plan.userns:
            step = "user namespace"
            # Made with the environment's own uid as its effective uid: the kernel charges
            # what every uid inside holds of the per-user limits (inotify instances and
            # watches, user namespaces, POSIX message queues, …) to the namespace's owner as
            # well, which must be the environment's uid, never host root's (a nobody job
            # could exhaust root's inotify instances). The real and saved uids stay 0, so the
            # permitted set stays: the effective set is taken back for the unshare (hosts that
            # allow new user namespaces to CAP_SYS_ADMIN alone).
            if launch.user.uid == 0:
                # A root job's supplementary groups, as host gids the namespace leaves
                # unmapped (see mapped_gids): set while still host root, kept by the unshare.
                os.setgroups(list(launch.user.groups))
            os.setresuid(-1, plan.userns, -1)
            _raise_effective()
            _check_call(libc.unshare(CLONE_NEWUSER))
            os.write(plan.ready_w, b"u")
        step = "wait for the init"
        if os.read(plan.go_r, 1) != b"g":
            os._exit(SETUP_FAILED)  # the init died: the PID namespace is going
        step = "drop capabilities"
        for cap in range(plan.last_cap + 1):
            if not plan.keep & (1 << cap):
                _check_call(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0))
        _check_call(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0))
        step = "set user"
        user = launch.user
        if not (plan.userns and user.uid == 0):
            os.setgroups(list(user.groups))  # a root job in a user namespace has set them
        os.setgid(user.gid)
        os.setuid(user.uid)  # from root to another uid: permitted and effective sets cleared
        step = "new session keyring"
        _new_session_keyring()
        step = "set capabilities"
        _capset(plan.keep if user.uid == 0 else 0)
        step = "no_new_privs"
        _check_call(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
        step = f"chdir {launch.cwd}"
        os.chdir(launch.cwd)
        if plan.seccomp is not None:
            step = "seccomp"
            plan.seccomp()
        step = "exec"
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        _exec(plan.argv, plan.environ)
    except BaseException as exc:
        _fail(plan.err_w, step, exc)
    os._exit(SETUP_FAILED)


def _new_session_keyring() -> None:
    """A new anonymous session keyring, the job user's: never the one of whoever ran envctl
    (an operator's Kerberos, AFS or ecryptfs keys). ENOSYS: a kernel without keys."""
    if libc.syscall(_NR["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), "keyctl")


def _dup_or_null(fd: int) -> int:
    """A copy of `fd`, or of the environment's /dev/null when the caller had it closed."""
    try:
        return os.dup(fd)
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
        return os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)


def _raise_effective() -> None:
    """Effective = permitted (what a change of euid from 0 cleared of the effective set)."""
    head = _CapHeader(CAP_VERSION_3, 0)
    data = (_CapData * 2)()
    _check_call(libc.syscall(_NR["capget"], ctypes.byref(head), data))
    for d in data:
        d.effective = d.permitted
    _check_call(libc.syscall(_NR["capset"], ctypes.byref(head), data))


def _capset(bits: int) -> None:
    """Effective = permitted = `bits`, inheritable none (after an exec a root job's permitted
    set is its bounding set plus its inheritable set: both are `bits` and nothing)."""
    head = _CapHeader(CAP_VERSION_3, 0)
    data = (_CapData * 2)(_CapData(bits & 0xFFFFFFFF, bits & 0xFFFFFFFF, 0),
                          _CapData(bits >> 32, bits >> 32, 0))
    _check_call(libc.syscall(_NR["capset"], ctypes.byref(head), data))


def _exec(argv: list[bytes], environ: dict[bytes, bytes]) -> None:
    """execve argv[0], looked up in environ's PATH unless it has a '/'; raises the OSError
    of the exec that failed: EACCES when a match was found but could not run, else ENOENT."""
    prog = argv[0]
    if b"/" in prog:
        os.execve(prog, argv, environ)
    denied: OSError | None = None
    for d in environ.get(b"PATH", DEFAULT_PATH.encode()).split(b":"):
        try:
            os.execve(posixpath.join(d or b".", prog), argv, environ)
        except OSError as exc:
            if exc.errno == errno.EACCES:
                denied = exc
            elif exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP,
                                   errno.ENAMETOOLONG):
                raise
    if denied is not None:
        raise denied
    raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), prog)
