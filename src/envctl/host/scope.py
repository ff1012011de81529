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
    from collections.abc import Callable, Sequence

    Runner = Callable[[list[str]], subprocess.CompletedProcess]


class ScopeError(Exception):
    """Why the scope could not be made or joined (the callers raise their own error kind)."""


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def attach_scope(unit: str, cgroup: str, pid: int, *, busctl: Sequence[str] = ("busctl",),
                 proc: str = "/proc", runner: Runner = run, timeout: float = 10.0) -> str:
    """Move running process `pid` into slice `unit` (whose cgroup is `cgroup`, relative to the
    hierarchy's root) as a transient scope made with D-Bus StartTransientUnit (busctl);
    returns the scope's name. A slice holds no process itself: the scope does, and goes away
    when its processes have exited. ScopeError when systemd refuses or `pid` is gone."""
    scope = f"{unit.removesuffix('.slice')}-{pid}.scope"
    argv = [*busctl, "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))",
            scope, "fail", "3", "PIDs", "au", "1", str(pid), "Slice", "s", unit,
            "CollectMode", "s", "inactive-or-failed", "0"]
    try:
        res = runner(argv)
    except OSError as exc:
        raise ScopeError(f"{argv[0]}: {exc.strerror}") from exc
    if res.returncode != 0:
        raise ScopeError(f"process {pid}: "
                         f"{(res.stderr or res.stdout or '').strip() or f'exit {res.returncode}'}")
    # The call only queues a job: wait until the process is in the scope (usually within a
    # millisecond or two; a launch waits on this, so poll fast at first).
    want = f"/{cgroup}/{scope}"
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(proc, str(pid), "cgroup")) as f:
                text = f.read()
        except FileNotFoundError as exc:
            raise ScopeError(f"process {pid} exited") from exc
        if any(line.endswith(want) for line in text.splitlines()):
            return scope
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    raise ScopeError(f"process {pid} not in {want} after {timeout:g} s")
