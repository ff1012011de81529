"""A process put into an environment's slice as a transient scope: the systemd driver's way of
placing a launch (envctl.runtime.launch.systemd_attach), and envctl.host.systemd's `attach`.

Its own small module because it is on the launch path: `exec` and `submit-job` have latency
targets, and envctl.host.systemd (with the cgroup adapter, the facts and the spec's units
behind it) costs ~20 ms to import; this imports subprocess and nothing of envctl's.
"""

from __future__ import annotations

import os
import subprocess
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    Runner = Callable[[list[str]], subprocess.CompletedProcess]


class ScopeError(Exception):
    """Why the scope could not be made or joined (the callers raise their own error kind)."""


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def attach_scope(unit: str, cgroup: str, pid: int, *, busctl: Sequence[str] = ("busctl",),
                 proc: str = "/proc", v1_mounts: Mapping[str, str] | None = None,
                 runner: Runner = run, timeout: float = 10.0,
                 properties: Sequence[tuple[str, ...]] = ()) -> str:
    """Move running process `pid` into slice `unit` (whose cgroup is `cgroup`, relative to the
    hierarchy's root) as a transient scope made with D-Bus StartTransientUnit (busctl);
    returns the scope's name once systemd has moved it (`v1_mounts`: v1 controller -> mount
    point, on a hybrid host; see `attached`). A slice holds no process itself: the scope does,
    and goes away when its processes have exited. ScopeError when systemd refuses or `pid`
    has ended (a zombie's pid is accepted and never moved). `properties`: more of the
    scope's, (name, D-Bus signature, value words...), e.g. ("MemoryMax", "t", "1073741824")
    or ("DeviceAllow", "a(ss)", "1", "/dev/char/195:0", "rw") as busctl takes them."""
    scope = f"{unit.removesuffix('.slice')}-{pid}.scope"
    argv = _call(busctl, unit, scope, pid, properties)
    try:
        res = runner(argv)
    except OSError as exc:
        raise ScopeError(f"{argv[0]}: {exc.strerror}") from exc
    _check(res.returncode, res.stderr or res.stdout, pid)
    return _wait_moved(scope, f"/{cgroup}/{scope}", pid, proc, v1_mounts or {}, timeout)


class ScopeCall:
    """A StartTransientUnit call under way for one process, so that the caller can go on with
    its own work meanwhile (`begin_scope`); `finish` waits for systemd to have moved it."""

    def __init__(self, child: subprocess.Popen, scope: str, want: str, pid: int, proc: str,
                 v1_mounts: Mapping[str, str]):
        self.child, self.scope, self.want, self.pid = child, scope, want, pid
        self.proc, self.v1_mounts = proc, v1_mounts

    def finish(self, timeout: float = 10.0) -> str:
        """The scope's name once the process is in it; ScopeError as `attach_scope`'s."""
        try:
            _, err = self.child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
            raise ScopeError(f"process {self.pid}: no answer from systemd in {timeout:g} s"
                             ) from None
        _check(self.child.returncode, err, self.pid)
        return _wait_moved(self.scope, self.want, self.pid, self.proc, self.v1_mounts, timeout)


def begin_scope(unit: str, cgroup: str, pid: int, scope: str, *,
                busctl: Sequence[str] = ("busctl",), proc: str = "/proc",
                v1_mounts: Mapping[str, str] | None = None) -> ScopeCall:
    """Ask systemd to move `pid` into a new transient scope named `scope` of slice `unit` (as
    `attach_scope` does), without waiting for the answer: `finish` on what it returns."""
    argv = _call(busctl, unit, scope, pid)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise ScopeError(f"{argv[0]}: {exc.strerror}") from exc
    return ScopeCall(child, scope, f"/{cgroup}/{scope}", pid, proc, v1_mounts or {})


def _call(busctl: Sequence[str], unit: str, scope: str, pid: int,
          properties: Sequence[tuple[str, ...]] = ()) -> list[str]:
    more = [word for prop in properties for word in prop]
    return [*busctl, "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))",
            scope, "fail", str(3 + len(properties)), "PIDs", "au", "1", str(pid), "Slice", "s",
            unit, "CollectMode", "s", "inactive-or-failed", *more, "0"]


def _check(returncode: int, message: str | None, pid: int) -> None:
    if returncode != 0:
        raise ScopeError(f"process {pid}: "
                         f"{(message or '').strip() or f'exit {returncode}'}")


def _wait_moved(scope: str, want: str, pid: int, proc: str, v1_mounts: Mapping[str, str],
                timeout: float) -> str:
    """The call only queues a job: wait until the process is in the scope at `want` (usually
    within a millisecond or two; a launch waits on this, so poll fast at first)."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(proc, str(pid), "cgroup")) as f:
                text = f.read()
        except FileNotFoundError as exc:
            raise ScopeError(f"process {pid} exited") from exc
        if attached(text, want, v1_mounts):
            return scope
        if _ended(proc, pid):
            raise ScopeError(f"process {pid} exited")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    raise ScopeError(f"process {pid} not in {want} after {timeout:g} s")


def attached(text: str, want: str, v1_mounts: Mapping[str, str]) -> bool:
    """Whether /proc/PID/cgroup `text` shows the process moved into the scope at `want`: its
    line of the systemd hierarchy (or cgroup2's) ends with it, and so does its line of every
    v1 controller hierarchy in which the scope has a cgroup. systemd moves a process into the
    systemd hierarchy first and then into each v1 one (a hybrid host), so the first line
    alone can be seen before the others; a controller the scope has no cgroup for stays
    where it was."""
    moved = False
    for line in text.splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if path.endswith(want):
            moved = True
        elif controllers and not controllers.startswith("name="):
            mount = v1_mounts.get(controllers.split(",")[0])
            if mount and os.path.isdir(mount.rstrip("/") + want):
                return False  # the scope has a cgroup there, and the process is not in it yet
    return moved


def _ended(proc: str, pid: int) -> bool:
    """Whether `pid` has exited (a zombie, or reaped)."""
    try:
        with open(os.path.join(proc, str(pid), "stat"), "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X")
