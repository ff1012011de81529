"""Entering an environment through gVisor (`runtime.isolation: gvisor`): the OCI bundle envctl
writes for each launch, and the init that drives `runsc` (create, start, kill)
in the launch's own PID namespace. Everything else is envctl.runtime.launch's.

API (called by launch.start for an environment whose context says gvisor):

    start(launch) -> Started       # as launch.start: returns once the job runs in the sandbox
    oci_config(ctx, *, argv, environ, user, cwd, caps, terminal, mounts) -> dict  # pure
    sub_mounts(root, mountinfo) -> list[SubMount]  # what the bundle binds again, from mountinfo
    sweep(box_dir) -> list[str]    # removes the bundles of launches that are gone

Processes. launch.start forks the launcher as for a native launch: it joins the environment's
network and mount namespaces, unshares mount, PID, UTS and IPC namespaces, binds `Launch.binds`
over the rootfs, waits until the caller has put it into the launch's cgroups, unshares the
cgroup namespace, and forks an init, here this module's: PID 1 of the new PID namespace, in
which every runsc process (the sandbox, the gofer, the short-lived commands) then lives. The
init mounts /proc for that namespace, takes the job's CPUs, writes `config.json`, runs `runsc
create` and `runsc start` as its children, and reaps until the sandbox (now its child) exits
with the job's code; FORWARDED_SIGNALS it receives go to the container's process through `runsc
kill`. When the job ends it removes the bundle and runsc's state, writes the job's wait status
to `status_fd` and exits with the job's code; so does the launcher. SIGKILL to the launcher
kills the init (PR_SET_PDEATHSIG) and the kernel kills the whole PID namespace with it: the
sandbox never outlives its launch.

Where things are: `<run>/<env>/gvisor/<id>/` holds `config.json`, runsc's state (`--root
state`), its log and the console socket; `<id>.lock` beside it is flock'd by the launch for
as long as it lives. A launch killed with SIGKILL leaves that directory (and nothing else:
no process, no mount): the next launch in the environment sweeps it, and `down` removes
`<run>/<env>` with everything in it, after the cgroup step has killed whatever ran.

Why `--network host`: the launcher already sits in the environment's network namespace, and
runsc then serves the sandbox's sockets from it (the environment's addresses, routes and
firewall). gVisor's own network stack (`--network sandbox`) takes an interface over for one
sandbox: every job of an environment shares one veth and one address, so it cannot; and
runsc 2022-12 refuses it on kernels whose every netns has /proc/sys/net/core/rmem_default.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from envctl.caps import NUMBERS
from envctl.errors import HostError
from envctl.host.libc import libc

if TYPE_CHECKING:
    # The native launch, whose steps this reuses. Not imported here: launch.start imports this
    # module, and hands itself over as `native` (envctl.runtime.launch, at run time).
    from envctl.runtime import launch as L  # noqa: N812
    from envctl.runtime.context import EnvContext

OCI_VERSION = "1.0.2"
BOX_DIR = "gvisor"  # <run>/<env>/BOX_DIR/<id>/
# The whole environment runsc is started with.
RUNSC_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Mount points gVisor makes its own file systems on (never bound from the environment's).
OWN_MOUNTS = ("/proc", "/sys", "/dev")
CLOSE_RANGE_CLOEXEC = 1 << 2
RESOLVE_IN_ROOT = 0x10  # openat2: resolve as if the directory were / (a chroot's view)
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
TIOCSWINSZ = 0x5414
# "…: creating process: failed to load /x: no such file or directory" from `runsc start`.
_LOAD_FAILED = re.compile(r"failed to load (.+?): (.+)$", re.M)
# "…: error finding executable "x" in PATH [/usr/bin /bin]: no such file or directory".
_NOT_IN_PATH = re.compile(r'error finding executable "(.+?)" in PATH \[.*?\]: (.+)$', re.M)
_LOAD_ERRNO = {"no such file or directory": errno.ENOENT, "not a directory": errno.ENOTDIR,
               "permission denied": errno.EACCES, "exec format error": errno.ENOEXEC}


class SubMount(NamedTuple):
    """A mount below the environment's rootfs (its /tmp, a data mount, the Python library):
    `target` inside the environment, `source` the host path that shows it, `read_only`."""

    source: str
    target: str
    read_only: bool


# ---------------------------------------------------------------- the bundle (pure)


def sub_mounts(root: str, mountinfo: str) -> list[SubMount]:
    """The mounts strictly below `root` in a /proc/PID/mountinfo text, in mount order, but
    those at or below OWN_MOUNTS (gVisor's /proc, /sys, /dev). The sandbox's root file system
    is one read-only mount of `root`: each of these is bound again so that it keeps its own
    writability (a read-write data mount, the environment's /tmp)."""
    root = root.rstrip("/")
    out: dict[str, SubMount] = {}
    for line in mountinfo.splitlines():
        fields = line.split(" - ")[0].split()
        if len(fields) < 6:
            continue
        point = _unescape(fields[4])
        if not point.startswith(root + "/"):
            continue
        target = point[len(root):]
        if any(target == d or target.startswith(d + "/") for d in OWN_MOUNTS):
            continue
        # A later mount on the same point hides the earlier one: the last one wins.
        out.pop(target, None)
        out[target] = SubMount(point, target, "ro" in fields[5].split(","))
    return list(out.values())


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (\\040 for a space, \\011, \\012, \\134)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def oci_config(ctx: EnvContext, *, argv: list[str], environ: dict[str, str], user: L.User,
               cwd: str, caps: tuple[str, ...], terminal: bool = False,
               mounts: list[SubMount] = ()) -> dict:
    """The OCI runtime spec (config.json, runtime-spec 1.0) of one launch: the environment's
    rootfs read-only, gVisor's own /proc, /sys (read-only) and /dev, each of `mounts` bound
    again, the job's argv, variables, working directory, user and capabilities, no new
    privileges, and the environment's name as hostname. No network namespace (runsc runs
    with --network host in the environment's, which the launcher joined) and no cgroupsPath
    (the launcher already sits in the launch's cgroup, and every runsc process inherits it)."""
    names = [f"CAP_{c.upper().removeprefix('CAP_')}" for c in caps]
    binds = [{"destination": m.target, "type": "bind", "source": m.source,
              "options": ["rbind", "ro" if m.read_only else "rw", "nosuid", "nodev"]}
             for m in mounts]
    return {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": terminal,
            "user": {"uid": user.uid, "gid": user.gid,
                     "additionalGids": [g for g in user.groups if g != user.gid]},
            "args": list(argv),
            "env": [f"{k}={v}" for k, v in environ.items()],
            "cwd": cwd,
            "capabilities": {"bounding": names, "effective": names, "permitted": names,
                             "inheritable": [], "ambient": []},
            "noNewPrivileges": True,
        },
        "root": {"path": str(ctx.root), "readonly": True},
        "hostname": ctx.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            *binds,
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]},
    }


def runsc_argv(runsc: str, box: Path, platform: str, *, network: bool) -> list[str]:
    """runsc's global flags for one launch: its own state root and log in the bundle, and
    --ignore-cgroups: without it runsc moves the sandbox into a cgroup of its own, named
    after the container, at the root of every hierarchy (out of the environment's limits,
    and left behind); with it every runsc process stays in the launch's cgroup, which the
    launcher joined, under the environment's limits and OOM counter."""
    return [runsc, "--root", str(box / "state"), "--log", str(box / "runsc.log"),
            "--ignore-cgroups", "--platform", platform or "ptrace",
            "--network", "host" if network else "none"]


def kept_caps(bits: int) -> tuple[str, ...]:
    """The capability names of a launch's kept bits (launch._check's `keep`)."""
    return tuple(name for name, num in sorted(NUMBERS.items(), key=lambda kv: kv[1])
                 if bits & (1 << num))


# ---------------------------------------------------------------- start


def box_dir(ctx: EnvContext) -> Path:
    """<run>/<env>/gvisor: the environment's run directory is beside its mount namespace
    holder's directory (<run>/mnt.d/<env>)."""
    return ctx.mntns.parent.parent / ctx.env / BOX_DIR


def start(launch: L.Launch, native: ModuleType) -> L.Started:
    """Start `launch` in gVisor: the native launcher with this module's init (see the
    module docstring). HostError when runsc is missing; LaunchError naming the runsc step
    that failed; CommandNotFound (exit 127) when the program is not in the environment."""
    from envctl.host.runsc import runsc_path

    runsc = runsc_path()
    if not runsc:
        raise HostError(f"enter environment '{launch.ctx.env}': it runs under gVisor and "
                        "runsc is not installed (Debian package 'runsc')")
    parent = box_dir(launch.ctx)
    try:
        parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise HostError(f"enter environment '{launch.ctx.env}': create {parent}: "
                        f"{exc.strerror}") from exc
    sweep(parent)
    ident, lock = _claim(parent, launch.ctx.env)
    try:
        box = parent / ident
        return native.start(launch, init=_Init(native, runsc, ident, box, lock))
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(parent / ident)
            (parent / f"{ident}.lock").unlink()
        raise
    finally:
        os.close(lock)  # the launcher and its init hold it (inherited) while they live


def _claim(parent: Path, env: str) -> tuple[str, int]:
    """A new container id and its bundle directory, with the launch's lock held: the lock
    is made and taken before the directory exists, so a sweep never takes a live one."""
    while True:
        ident = f"{env}-{os.urandom(5).hex()}"
        lock_path = parent / f"{ident}.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue  # EEXIST: that id is taken; draw another
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            linked = os.stat(lock_path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            linked = False
        if not linked:
            os.close(fd)  # a sweep took it for a dead launch's between the open and the lock
            continue
        (parent / ident).mkdir(mode=0o700)
        return ident, fd


def sweep(parent: Path) -> list[str]:
    """Remove the bundle directories (and runsc state) of launches that are gone: their lock
    is free. Returns the ids removed. A live launch holds its lock, so it is never touched."""
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.endswith(".lock"):
            continue
        try:
            fd = os.open(parent / name, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # its launch cleaned up meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # EWOULDBLOCK: its launch is alive
        ident = name.removesuffix(".lock")
        try:
            shutil.rmtree(parent / ident, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError):
                (parent / name).unlink()
            removed.append(ident)
        finally:
            os.close(fd)
    for name in names:
        # A directory without its lock: a cleanup or sweep died between the two removals (a
        # live launch's lock exists before its directory does).
        if (not name.endswith(".lock") and name not in removed
                and not (parent / f"{name}.lock").exists() and (parent / name).is_dir()):
            shutil.rmtree(parent / name, ignore_errors=True)
            removed.append(name)
    return removed


# ---------------------------------------------------------------- the init


class _Init:
    """The init of a gVisor launch (launch._launcher forks it as PID 1 of the new PID
    namespace and calls it with the launch, the launcher's plan and the liveness pipe)."""

    def __init__(self, native: ModuleType, runsc: str, ident: str, box: Path, lock: int):
        self.native = native
        self.runsc = runsc
        self.ident = ident
        self.box = box
        self.lock = lock
        self.started = False
        self.pending: list[int] = []
        self.base: list[str] = []
        self.relay = 0  # the child copying the sandbox's stdio pipes (_relayed)

    def __call__(self, launch: L.Launch, plan: L._Plan, alive_r: int) -> NoReturn:
        L = self.native  # noqa: N806 - envctl.runtime.launch
        step = "init"
        try:
            L._check_call(libc.prctl(L.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
            # EOF: the launcher died before the prctl took effect (see launch._init).
            if _readable(alive_r):
                os._exit(L.SETUP_FAILED)
            os.close(alive_r)
            for sig in L.FORWARDED_SIGNALS:
                signal.signal(sig, self._on_signal)
            # Nothing this init runs inherits a descriptor but its stdio.
            L._check_call(libc.syscall(L._NR["close_range"], 3, ctypes.c_uint(0xFFFFFFFF),
                                       CLOSE_RANGE_CLOEXEC))
            step = "mount /proc"
            # /proc of the new PID namespace (in the launcher's private mount namespace):
            # runsc finds its sandbox's processes by the pids it sees.
            L._check_call(libc.mount(b"proc", b"/proc", b"proc",
                                     ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC), None))
            step = "set CPU affinity"
            os.sched_setaffinity(0, plan.cpus)  # the sandbox's threads inherit it
            step = f"chdir {launch.cwd}"
            _check_dir(launch.ctx.root, launch.cwd)  # runsc would make a missing one
            step = "write the OCI bundle"
            self.base = runsc_argv(self.runsc, self.box, launch.ctx.platform,
                                   network=launch.ctx.netns is not None)
            self._write_bundle(launch, plan)
            console = None
            if launch.pty:
                step = "open the console socket"
                # Named through this init's descriptor of the bundle directory: the bundle's
                # own path may be longer than a socket address holds (108 bytes). This init
                # is PID 1 of the /proc just mounted, which runsc, its child, sees too.
                box_fd = os.open(self.box, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                console_path = f"/proc/1/fd/{box_fd}/console.sock"
                console = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                console.bind(console_path)
                console.listen(1)
            step = "runsc create"
            create = [*self.base, "create", "--bundle", str(self.box), "--pid-file",
                      str(self.box / "sandbox.pid")]
            if console is not None:
                create += ["--console-socket", console_path]
            create.append(self.ident)
            stdio = tuple(_usable(fd) for fd in launch.stdio)
            stdio = (stdio[0], *_appending(stdio[1:]))
            # The sandbox gets pipes in place of files and terminals: gVisor's Sentry carries
            # a root job's fchown and fchmod of a donated host descriptor out to the host
            # inode (the submitter's --output file, the caller's terminal).
            if not launch.pty:  # with one, the job's stdio is the console, not these
                stdio, self.relay = _relayed(stdio)
            try:
                if self._run(create, stdio) != 0:
                    raise OSError(0, "", self._log_error("create"))
            finally:
                for fd, given in zip(stdio, launch.stdio, strict=True):
                    if fd != given and fd not in launch.stdio:
                        os.close(fd)  # the sandbox holds the job's ends now
            if console is not None:
                step = "open a pseudo-terminal"
                self._pass_console(console, launch, plan)
            step = "runsc start"
            rc, err = self._run_captured([*self.base, "start", self.ident])
            if rc != 0:
                failed = _LOAD_FAILED.search(err)
                failed = failed or _NOT_IN_PATH.search(err)
                if failed and failed.group(2).strip() in _LOAD_ERRNO:
                    step = "exec"
                    no = _LOAD_ERRNO[failed.group(2).strip()]
                    raise OSError(no, os.strerror(no), failed.group(1))
                raise OSError(0, "", err.strip().splitlines()[-1] if err.strip()
                              else self._log_error("start"))
            self.started = True
            for sig in self.pending:
                self._kill(sig)
            self.pending.clear()
            for fd in (plan.err_w, plan.sock):
                if fd >= 0:
                    os.close(fd)
        except BaseException as exc:
            self._cleanup()
            L._fail(plan.err_w, step, exc)
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, L.FORWARDED_SIGNALS)
            status = self._wait()
            self._cleanup()
            if launch.status_fd is not None:
                with contextlib.suppress(OSError):
                    os.write(launch.status_fd, f"{status}\n".encode())
            os._exit(L.exit_code(status))
        finally:
            os._exit(L.SETUP_FAILED)

    # -- the steps

    def _write_bundle(self, launch: L.Launch, plan: L._Plan) -> None:
        with open("/proc/self/mountinfo") as f:
            mounts = sub_mounts(str(launch.ctx.root), f.read())
        config = oci_config(launch.ctx, argv=launch.argv, environ=launch.environ,
                            user=launch.user, cwd=launch.cwd, caps=kept_caps(
                                plan.keep if launch.user.uid == 0 else 0),
                            terminal=launch.pty, mounts=mounts)
        (self.box / "state").mkdir(mode=0o700, exist_ok=True)
        (self.box / "config.json").write_text(json.dumps(config, indent=1))

    def _pass_console(self, console: socket.socket, launch: L.Launch, plan: L._Plan) -> None:
        """The pseudo-terminal's master that runsc sent to the console socket, on to the
        caller (launch._started receives it), sized as asked."""
        console.settimeout(10)
        conn, _ = console.accept()
        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 16, 1)
        console.close()
        if not fds:
            raise OSError(errno.EPROTO, "runsc sent no terminal", "console socket")
        try:
            if launch.winsize:
                rows, cols = launch.winsize
                fcntl.ioctl(fds[0], TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            with socket.socket(fileno=os.dup(plan.sock)) as s:
                socket.send_fds(s, [b"m"], [fds[0]])
        finally:
            os.close(fds[0])

    def _wait(self) -> int:
        """Reap everything until the sandbox ends, and read the job's raw wait status from
        the sandbox's own exit. This is PID 1: the sandbox and the gofer become its children
        when `runsc create` exits, and the sandbox exits with its root process's code, 128+N
        for a signal N, as `runsc run` and a shell report it: read back as signal N. (`runsc
        wait` cannot be used: a job that ends before it asks leaves it "sandbox no longer
        running and its exit status is unavailable".) A sandbox killed itself (SIGKILL; the
        OOM killer chose the Sentry) is the job's death by that signal."""
        try:
            sandbox = int((self.box / "sandbox.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            sandbox = 0
        relay_done = self.relay == 0
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return signal.SIGKILL  # ECHILD: it was never ours to reap
            relay_done = relay_done or pid == self.relay
            if pid == sandbox:
                break
        if not relay_done:  # what the job wrote last, copied once every writer is gone
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.relay, 0)
        if os.WIFSIGNALED(status):
            return status
        code = os.waitstatus_to_exitcode(status)
        if code > 128 and code - 128 in signal.valid_signals():
            return code - 128  # the wait status of a death by signal code-128
        return (code & 0xFF) << 8

    def _cleanup(self) -> None:
        """Remove the bundle, runsc's state and the lock file. No `runsc delete`: every runsc
        process lives in this init's PID namespace, which the kernel empties when the init
        exits, and runsc's state is files in the bundle (--root). (`runsc delete --force`
        after the sandbox ended also waits 5 s for the gofer, a zombie until this init reaps
        it.) A crash before this is the sweep's and `down`'s to tidy."""
        shutil.rmtree(self.box, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.box.parent / f"{self.ident}.lock").unlink()

    def _on_signal(self, sig: int, frame: object) -> None:
        if self.started:
            self._kill(sig)
        else:
            self.pending.append(sig)  # delivered once the container runs

    def _kill(self, sig: int) -> None:
        with contextlib.suppress(OSError):
            self._run([*self.base, "kill", self.ident, str(int(sig))],
                      (_devnull(), _devnull(), _devnull()))

    # -- running runsc

    def _run(self, argv: list[str], stdio: tuple[int, int, int]) -> int:
        pid = _spawn(argv, stdio, self.native.FORWARDED_SIGNALS)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                return os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                return 1

    def _run_captured(self, argv: list[str]) -> tuple[int, str]:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        try:
            rc = self._run(argv, (_devnull(), _devnull(), err_w))
        finally:
            os.close(err_w)
        text = _read_all(err_r).decode(errors="replace")
        os.close(err_r)
        return rc, text

    def _log_error(self, what: str) -> str:
        """runsc's own account of a failure: the error lines of its log (JSON records)."""
        try:
            text = (self.box / "runsc.log").read_text(errors="replace")
        except OSError:
            text = ""
        msgs = [m.group(1) for m in re.finditer(r'"msg":"((?:[^"\\]|\\.)*)","level":"error"',
                                                text)]
        if not msgs:
            return f"runsc {what} failed (its log: {self.box / 'runsc.log'})"
        # The first names the cause, the last what runsc was doing.
        first = json.loads(f'"{msgs[0]}"').splitlines()[0]
        last = json.loads(f'"{msgs[-1]}"').splitlines()[0]
        return first if first == last else f"{last}: {first}"


_NULL: list[int] = []


def _check_dir(root: Path, path: str) -> None:
    """OSError unless `path` is a directory of the environment, resolved inside `root` as the
    native launch's chdir after pivot_root resolves it (`runsc create` makes a missing working
    directory; a native launch refuses it, and so does this)."""
    from envctl.host import safepath

    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.close(safepath.openat2(root_fd, path.lstrip("/") or ".",
                                  os.O_PATH | os.O_DIRECTORY,
                                  resolve=RESOLVE_IN_ROOT | safepath.RESOLVE_NO_MAGICLINKS))
    except safepath.Escape as exc:
        raise OSError(exc.errno, os.strerror(exc.errno), path) from None
    finally:
        os.close(root_fd)


def _devnull() -> int:
    if not _NULL:
        _NULL.append(os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC))
    return _NULL[0]


def _usable(fd: int) -> int:
    """`fd` when it is open, else /dev/null (a caller's closed stdio, as launch does)."""
    try:
        os.fstat(fd)
    except OSError:
        return _devnull()
    return fd


_MAX_FD = 1 << 20  # above any RLIMIT_NOFILE envctl runs with (closerange stops at the last)


def _relayed(stdio: tuple[int, ...]) -> tuple[tuple[int, int, int], int]:
    """`stdio` with a pipe in place of each descriptor that is not one already (or a socket,
    or /dev/null), and the pid of the child that copies them (0: none): stdin's source into
    its pipe, the pipes of stdout and stderr out to their files. The child ends when every
    copy has (the job's outputs end when the sandbox does); the init waits for it."""
    import stat

    out = list(stdio)
    copies: list[tuple[int, int, bool]] = []  # (from, to, an output), the copier's
    for target, fd in enumerate(stdio):
        r, w = os.pipe2(os.O_CLOEXEC)
        pipefs = os.fstat(r).st_dev  # every anonymous pipe's: a named FIFO is a host inode
        st = os.fstat(fd)
        if (stat.S_ISFIFO(st.st_mode) and st.st_dev == pipefs) or stat.S_ISSOCK(st.st_mode) \
                or fd == _devnull():
            os.close(r)
            os.close(w)
            continue
        if target == 0:
            out[0] = r
            copies.append((fd, w, False))
        else:
            out[target] = w
            copies.append((r, fd, True))
    if not copies:
        return (out[0], out[1], out[2]), 0
    pid = os.fork()
    if pid == 0:
        try:
            # Nothing but the copies: the sandbox's ends held here, the job's outputs would
            # never end; the init's error pipe, the caller would wait for the start forever.
            low = 0
            for keep in sorted({fd for src, dst, _ in copies for fd in (src, dst)}):
                os.closerange(low, keep)
                low = keep + 1
            os.closerange(low, _MAX_FD)
            _copy_all(copies)
        finally:
            os._exit(0)
    for src, dst, output in copies:  # the copier's pipe ends
        os.close(src if output else dst)
    return (out[0], out[1], out[2]), pid


def _copy_all(copies: list[tuple[int, int, bool]]) -> None:
    """Copy each (from, to, an output), a thread each (a stdin that waits for room must not
    hold up the outputs), until every output's source has ended: stdin's copy (a terminal or
    a device may never end) goes with this process."""
    import threading

    def copy(src: int, dst: int, output: bool) -> None:
        while True:
            try:
                data = os.read(src, 65536)
            except OSError:
                data = b""
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(dst, view):]
                except OSError:
                    return  # the other side is gone: nothing more to copy
            if not data:
                if not output:
                    os.close(dst)  # stdin's pipe: the job's end of input
                return

    threads = [(threading.Thread(target=copy, args=c, daemon=True), c[2]) for c in copies]
    for t, _ in threads:
        t.start()
    for t, output in threads:
        if output:
            t.join()


def _appending(fds: tuple[int, ...]) -> tuple[int, ...]:
    """The job's output descriptors, each regular file reopened with O_APPEND: the Sentry
    writes each stdio descriptor at an offset of its own, so stdout and stderr sharing one
    file (`--output` = `--error`) would write over each other. Reopened (a new open file
    description through /proc/self/fd), never changed in place: the caller's own descriptor
    (`envctl exec … >>log` in a shell) keeps its flags. Anything else is returned as it is."""
    import stat

    out = []
    for fd in fds:
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        except OSError:
            pass  # as it is: at worst the two streams of one file overlap
        out.append(fd)
    return tuple(out)


def _spawn(argv: list[str], stdio: tuple[int, int, int], handled: tuple[int, ...]) -> int:
    """posix_spawn argv with `stdio` as 0, 1, 2 (every other descriptor is close-on-exec),
    the signals the init handles (`handled`) back to their defaults and none blocked. runsc
    gets a PATH and nothing else of the caller's environment (an operator's tokens, agent
    sockets): the job's own variables reach it through config.json."""
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(stdio)]
    return os.posix_spawn(argv[0], argv, {"PATH": RUNSC_PATH},
                          file_actions=actions, setsigdef=(*handled, signal.SIGPIPE),
                          setsigmask=())


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            return out
        out += chunk
