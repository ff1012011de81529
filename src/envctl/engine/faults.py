"""Fault injection for tests: ENVCTL_FAULT makes a chosen step fail, hang or die at a chosen point.

Syntax: comma-separated `ACTION@POINT:PATTERN` where
  ACTION  fail | kill | sleep<SECONDS> | until=<PATH> (block until PATH exists: a test
          holds envctl at a point for exactly as long as it needs, without timing luck;
          PATH.waiting is made first, so that the test knows the point is reached) |
          errno=<NAME> (raise OSError NAME, e.g. errno=ENOSPC: what a full disk does)
  POINT   before (nothing journalled yet), apply (journalled, host not yet changed),
          after (host changed, not yet journalled as applied), remove (before a removal),
          fold (after the N-th file operation of folding a journal or the ledger),
          record (a job's supervisor about to write the job's record),
          submit (the daemon's submit: `before` it writes anything, `after` the record,
          before its answer),
          claim (a pass of the job queue claiming a job, keyed by the step and `#` the job's
          id: `listed` in the holders' index, its `record` claimed, the queue's `index`
          rewritten, its `start` about to spawn the supervisor, `own`: the new supervisor
          about to take the claim over; runtime.queue.claim)
  PATTERN a glob on the step key (`sysctl:net.*`, `netns:*`; for fold the file name,
          `alpha.json`, `shared.json`; for record the state written, `RUNNING`,
          `COMPLETED`), `#N` (the step's index, the fold's operation, the N-th attempt at
          writing that state), or both: `alpha.json#2`.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import time

from envctl.errors import HostError

POINTS = ("before", "apply", "after", "remove", "fold", "record", "submit", "claim")


class InjectedFault(HostError):
    """A failure requested through ENVCTL_FAULT."""


def _rules() -> list[tuple[str, str, str]]:
    spec = os.environ.get("ENVCTL_FAULT", "")
    rules = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, _, rest = item.partition("@")
        point, _, pattern = rest.partition(":")
        if point not in POINTS or not pattern:
            raise ValueError(f"bad ENVCTL_FAULT rule '{item}'")
        rules.append((action, point, pattern))
    return rules


def maybe_fault(point: str, key: str, index: int) -> None:
    """Act on the first ENVCTL_FAULT rule matching this point and step, if any."""
    if "ENVCTL_FAULT" not in os.environ:
        return
    for action, p, pattern in _rules():
        if p != point:
            continue
        glob, _, number = pattern.partition("#")
        if number and number != str(index):
            continue
        if glob and not fnmatch.fnmatchcase(key, glob):
            continue
        if action == "fail":
            raise InjectedFault(f"injected fault {action}@{point} at '{key}'")
        if action.startswith("errno="):
            import errno

            code = getattr(errno, action[6:])
            raise OSError(code, f"{os.strerror(code)} (injected fault {action}@{point} at "
                          f"'{key}')")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action.startswith("sleep"):
            time.sleep(float(action[5:] or 1))
        if action.startswith("until="):
            # PATH.waiting says the point is reached: a test waits for that, not for luck.
            with open(action[6:] + ".waiting", "w"):
                pass
            deadline = time.monotonic() + 600
            while not os.path.exists(action[6:]) and time.monotonic() < deadline:
                time.sleep(0.01)
