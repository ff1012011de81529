"""What the detached supervisors (a job's, an environment's service's) share with the command
that starts them: the start report read over a pipe, and waiting on a descriptor."""

from __future__ import annotations

import math
import os
import select
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: see record.py
if TYPE_CHECKING:
    from collections.abc import Callable

# How long a starting supervisor may take to say it runs (or why it cannot).
START_TIMEOUT = 60.0
# The longest single poll(): its timeout is milliseconds in a C int (~24.8 days overflow it,
# OverflowError), so a longer wait (a time limit or a grace of up to 365 days) loops.
POLL_MAX = 86400.0


# A supervisor's oom_score_adj: never the OOM killer's choice (slurmstepd's value). Its jobs
# get 0 back (launch.Launch.oom_score_adj): the victim is chosen among what the jobs run.
SUPERVISOR_OOM_SCORE_ADJ = -1000


def protect_from_oom() -> bool:
    """Make this process (a supervisor) the OOM killer's last choice: killing it would take
    its job's record and cgroup clean-up with it, and then its job. False when the kernel
    refused (no CAP_SYS_RESOURCE, e.g. inside a container): it runs on unprotected."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(SUPERVISOR_OOM_SCORE_ADJ))
        return True
    except OSError:
        return False


def poll_ms(seconds: float | None) -> int | None:
    """poll()'s timeout for a wait of `seconds` (None: none), bounded by POLL_MAX: a caller
    that wakes on the bound sees its deadline not yet reached and polls again."""
    if seconds is None:
        return None
    return math.ceil(min(max(0.0, seconds), POLL_MAX) * 1000)  # ceil: never a 0 ms spin


def wait_fd(fd: int, timeout: float | None) -> bool:
    """Whether `fd` (a pidfd: the process ended; a pipe: data or EOF) became readable within
    `timeout` seconds (None: no limit)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if timeout is None:
        return bool(poller.poll(None))
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        if poller.poll(poll_ms(deadline - time.monotonic())):
            return True
        if time.monotonic() >= deadline:
            return False


def read_report(r: int, *, on_pid: Callable[[], None] | None = None) -> tuple[str, str]:
    """What the supervisor says, as (kind, text): "R" once the job runs (its record says
    RUNNING), "E" with why it could not start it (its record is final), "dead" when it died
    before either, "timeout" when it said nothing in START_TIMEOUT seconds.

    Lines: "P <pid>" first (a job's supervisor says it once its own first record is written),
    then "R" or "E <why>"; "E" alone when it could not write that record. Its pid is watched
    through a pidfd, not only the pipe, which the launch's processes may still hold open
    after it died. `on_pid()` is called once, at "P", before the wait goes on."""
    buf = b""
    pidfd = None
    poller = select.poll()
    poller.register(r, select.POLLIN)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            lines = buf.split(b"\n")
            for line in lines[:-1]:
                text = line.decode(errors="replace")
                if text.startswith("P ") and pidfd is None:
                    try:
                        pidfd = os.pidfd_open(int(text[2:]))
                    except ProcessLookupError:
                        return "dead", "it exited without a report"
                    poller.register(pidfd, select.POLLIN)
                    if on_pid is not None:
                        on_pid()
                elif text == "R":
                    return "R", ""
                elif text.startswith("E "):
                    return "E", text[2:]
            buf = lines[-1]
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", f"no report in {START_TIMEOUT:g} s"
            events = dict(poller.poll(poll_ms(left)))
            if r in events:
                data = os.read(r, 4096)
                if not data:
                    return "dead", "it exited without a report"
                buf += data
            elif pidfd is not None and pidfd in events:
                return "dead", "it exited without a report"
    finally:
        if pidfd is not None:
            os.close(pidfd)
